def get_cann_version():
    return "8.0.0"

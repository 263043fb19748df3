def reset_thread_affinity(*args, **kwargs):
    return None

class FlopsCounter:
    def __init__(self, *a, **k):
        pass

    def start(self):
        pass

    def stop(self):
        pass

    def get_flops(self):
        return [0, 0]

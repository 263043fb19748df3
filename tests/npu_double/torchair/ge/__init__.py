"""``torchair.ge`` of the CPU test double: type names for annotations, nothing callable."""


class Tensor:
    pass


class TensorSpec:
    pass


class DataType:
    pass


def __getattr__(name):
    def op(*args, **kwargs):
        raise RuntimeError(f"torchair test double: ge.{name} called on CPU")
    return op

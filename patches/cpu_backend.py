"""CPU backend patch set (placeholder: being written)."""
PATCHES = []


def autoenable():
    return False

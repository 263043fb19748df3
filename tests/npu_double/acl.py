"""CPU test double of ``acl`` (Ascend Computing Language runtime bindings; tests only):
MindSpeed-LLM imports it at module level; nothing here is called on CPU."""


def __getattr__(name):
    raise AttributeError(f"acl test double: acl.{name} is not available on CPU")

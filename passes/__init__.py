"""graphattn.passes: the Dynamo backend that splits the traced model at the attention ops."""

if __name__ != "graphattn.passes":
    raise ImportError(
        f"graphattn's compiler package was imported as {__name__!r}; it only works as "
        "'graphattn.passes'. Install the checkout (pip install -e .) instead of putting "
        "the repository root on sys.path."
    )

"""The CLI (``cli``) and ``tidegate up`` (``launcher``): the composition root, the one place in
``tidegate/`` that imports the roles (lazily, inside functions).
"""

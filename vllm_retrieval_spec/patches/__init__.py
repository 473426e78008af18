"""The wrappers ``plugin.register()`` applies to vLLM, by the part of the step they serve; the
inventory of what each wraps is in ``plugin.py``."""

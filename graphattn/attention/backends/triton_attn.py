"""TRITON: the production backend (kernels in graphattn.kernels); filled in by the Triton issue."""

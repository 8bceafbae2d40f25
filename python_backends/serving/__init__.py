"""The serving cores, free of Triton: what each Python model does, driven by thin adapters in
`zipmoe.models` (Triton request -> typed request -> core -> Triton response)."""

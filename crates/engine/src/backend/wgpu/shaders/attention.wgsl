// attention.wgsl: (to be written)

// gdn.wgsl: (to be written)

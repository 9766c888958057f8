"""The built-in tiny models of `dlo demo`, `dlo inspect` and `dlo make-tiny` (real diffusers
classes, tiny configs, random seeded weights). Not public API: they may change with the commands."""

"""A diffusers pipeline directory as the commands run it: its class and components (loading.py),
the sizes it accepts (call_rules.py), the files it writes (media_output.py, output_path.py), and
the other libraries' console noise kept down (library_noise.py). Used by `dlo generate` and by
dlo.serve."""

"""Example environments: short files of the kind a researcher writes, usable as `path/to/file.py:ClassName`."""

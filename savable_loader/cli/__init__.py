"""The command line: ``python -m savable_loader demo | inspect | index``.

* ``main``: the parser and the commands (imports neither torch nor the loader at import
  time); ``demo`` / ``demo_train``: the kill-and-resume demo; ``inspect``: a state file
  summarised without torch.

May import: ``savable_loader`` (the public face, for the demo's training), ``sources``, ``state``, ``stats``, ``errors``, ``_version`` (each command imports what it needs when it runs).
"""

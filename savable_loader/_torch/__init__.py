"""torch's private DataLoader parts, in one place: each detected per torch release and
loud when missing (``internals``).

May import: ``errors``.
"""

"""The commands of `tangram`, one module per command or command group.

cli.py holds the app and the table of commands; it imports a module here only when its
command runs, so every module may import what its command needs at the top.
"""

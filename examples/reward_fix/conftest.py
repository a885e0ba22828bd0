# pytest puts this directory (the sandbox's /work) on sys.path, so tests import calc

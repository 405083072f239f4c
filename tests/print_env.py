"""``python -m tests.print_env NAME...``: the named environment variables as one JSON object on stdout (unset
ones null): what a process started by the tests sees (tests/test_forkserver.py)."""

from __future__ import annotations

import json
import os
import sys

if __name__ == "__main__":
    print(json.dumps({name: os.environ.get(name) for name in sys.argv[1:]}))

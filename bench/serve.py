"""Load generator for any OpenAI-compatible server: a thin wrapper over `metrale bench`.

    python bench/serve.py --url http://127.0.0.1:8000 --concurrency 1 8 32 --requests 64 \\
        --prompt-len 128 --output-len 128

is `metrale bench` with the same flags (`metrale bench --help` lists them; serving/cli/bench.py
and serving/cli/bench_load.py do the work). Only talks to the URL it is given.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from serving.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))

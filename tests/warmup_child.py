"""A stand-in for ``engines.compile_warmup``'s child in tests: what it does is spelled in the candidate's name.

``sleep-S``: sleeps S seconds, then answers ok; ``fail``: answers an error; ``crash``: exits 3 with no answer.
Each child appends its name to ``started.log`` beside the request folders' parent, so tests see the order.
"""

import json
import sys
import time
from pathlib import Path


def main(request_path: str, result_path: str) -> int:
    request = json.loads(Path(request_path).read_text())
    name = request["name"]
    with open(Path(request["weights"]).with_name("started.log"), "a") as log:
        log.write(name + "\n")
    if name == "crash":
        print("the child fell over", flush=True)
        return 3
    if name == "fail":
        Path(result_path).write_text(json.dumps({"error": "KKError: no graph"}))
        return 0
    time.sleep(float(name.split("-")[1]))
    Path(result_path).write_text(json.dumps({"ok": True, "compile_seconds": 0.5}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))

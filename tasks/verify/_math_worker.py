"""The math worker process (``python -m tasks.verify._math_worker``): math-verify verdicts in
its own main thread, where math-verify's time limit works. One JSON object a line on stdin
(``gold``, ``predicted``), one a line on stdout (``status`` ok with ``equal``, or timeout with
``message``); it says ``ready`` first and exits when stdin closes."""
from __future__ import annotations

import json
import sys

from tasks.verify.math import MathVerifyTimeout, _equivalent_here


def main() -> None:
    print(json.dumps({"status": "ready"}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"status": "ok", "equal": _equivalent_here(request["gold"], request["predicted"])}
        except MathVerifyTimeout as e:
            reply = {"status": "timeout", "message": str(e)}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()

"""The cluster's S3 endpoint as the hosts see it: a TCP proxy (tests/_tcp_proxy.py) on ctl in
front of moto's server, so an outage can be made on purpose:

    python tests/cluster/s3_proxy.py LISTEN_PORT TARGET_PORT OUTAGE_S CONTROL_FILE

When CONTROL_FILE appears (the test writes it) an outage of OUTAGE_S seconds starts: every open
connection is reset and new ones are refused, then it listens again. Each outage is logged (start
and end, time.time())."""
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _tcp_proxy import TcpProxy  # noqa: E402


def main() -> None:
    listen, target, outage, control = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    with TcpProxy(target, host="0.0.0.0", port=listen) as proxy:
        print(f"listening on {listen} -> 127.0.0.1:{target}", flush=True)
        while True:
            if not os.path.exists(control):
                time.sleep(0.1)
                continue
            os.unlink(control)
            print(f"outage start {time.time():.3f}", flush=True)
            proxy.cut(outage)
            time.sleep(outage + 0.5)
            print(f"outage end {proxy.cuts[-1][1]:.3f}", flush=True)


if __name__ == "__main__":
    main()

#!/usr/bin/env bash
# Stop Ray on this node (head or worker). Stop `ppserve serve` first (Ctrl-C or SIGTERM) so it can
# finish in-flight requests and tear its pipeline down.
set -euo pipefail
ray stop

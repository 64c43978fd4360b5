#!/bin/bash
cd /work/main
MAX=${MAX:-444}
.venv/bin/headrace mock --port 9401 --tpot-ms 0 --max-tokens 20 > /tmp/soak/m1b.log 2>&1 &
.venv/bin/headrace mock --port 9402 --tpot-ms 0 --max-tokens 20 > /tmp/soak/m2b.log 2>&1 &
.venv/bin/headrace serve --port 9410 --workers 1 --backend http://127.0.0.1:9401 --backend http://127.0.0.1:9402 --set server.access_log=true > /tmp/soak/router2.log 2>&1 &
for i in $(seq 1 60); do curl -s -o /dev/null localhost:9410/health && break; sleep 0.5; done
for pct in 50 80 95; do
  R=$((MAX * pct / 100))
  echo "== open loop ${R} req/s (${pct}% of ${MAX}) 30 s $(date)"
  .venv/bin/headrace bench --target http://127.0.0.1:9410 --rps $R --duration 30 --stream --client lean --max-tokens 20 --json /tmp/soak/open2_${pct}.json --plot /tmp/soak/open2_${pct}.png > /tmp/soak/open2_${pct}.log 2>&1
  grep "^target" /tmp/soak/open2_${pct}.log
done
kill %1 %2 %3; wait
echo "router log: POST lines not 200: $(grep 'POST' /tmp/soak/router2.log | grep -vc '" 200 ')  tracebacks: $(grep -c Traceback /tmp/soak/router2.log)"

#!/bin/bash
# Zero-error soak (issue 12): two mocks --tpot-ms 0 --max-tokens 20, one router process with the access log;
# 10 min h2c closed loop (h2load -c 32), 10 min HTTP/1.1 closed loop (wrk -c 32, Lua: 200 + [DONE], no in-band error),
# then open loop at 50/80/95% of the max rate (headrace bench --client lean), 30 s each. Logs under /tmp/soak.
cd /work/main
D=${D:-600}; MAX=${MAX:-600}
.venv/bin/headrace mock --port 9401 --tpot-ms 0 --max-tokens 20 > /tmp/soak/m1.log 2>&1 &
.venv/bin/headrace mock --port 9402 --tpot-ms 0 --max-tokens 20 > /tmp/soak/m2.log 2>&1 &
.venv/bin/headrace serve --port 9410 --workers 1 --backend http://127.0.0.1:9401 --backend http://127.0.0.1:9402 --set server.access_log=true > /tmp/soak/router.log 2>&1 &
for i in $(seq 1 60); do curl -s -o /dev/null localhost:9410/health && break; sleep 0.5; done
echo '{"model":"mock","prompt":"hello world","max_tokens":20,"stream":true}' > /tmp/soak/body.json
echo "== h2c closed loop ${D}s $(date)"
h2load -c 32 -m 1 -D $D -d /tmp/soak/body.json -H 'content-type: application/json' http://127.0.0.1:9410/v1/completions > /tmp/soak/h2load.out 2>&1
grep -E "finished in|^requests:|^status codes:" /tmp/soak/h2load.out
cat > /tmp/soak/wrk.lua <<'LUA'
local body = io.open("/tmp/soak/body.json", "r"); wrk.body = body:read("*a"); body:close()
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
bad = 0
local threads = {}
function setup(thread) table.insert(threads, thread) end
function response(status, headers, text)
  if status ~= 200 or not text:find("data: [DONE]", 1, true) or text:find('{"error"', 1, true) then bad = bad + 1 end
end
function done(summary, latency, requests)
  local n = 0
  for _, t in ipairs(threads) do n = n + t:get("bad") end
  io.write(string.format("incomplete or not 200: %d\n", n))
end
LUA
echo "== HTTP/1.1 closed loop ${D}s $(date)"
wrk -c 32 -t 1 -d ${D}s -s /tmp/soak/wrk.lua http://127.0.0.1:9410/v1/completions > /tmp/soak/wrk.out 2>&1
grep -E "requests in|Non-2xx|Socket errors|incomplete|Requests/sec" /tmp/soak/wrk.out
for pct in 50 80 95; do
  R=$((MAX * pct / 100))
  echo "== open loop ${R} req/s (${pct}% of ${MAX}) 30 s $(date)"
  .venv/bin/headrace bench --target http://127.0.0.1:9410 --rps $R --duration 30 --stream --client lean --max-tokens 20 --json /tmp/soak/open_${pct}.json > /tmp/soak/open_${pct}.log 2>&1
  grep -iE "error|ok|p50|p99|req/s" /tmp/soak/open_${pct}.log | grep -v "\[" | tail -8
done
kill %1 %2 %3; wait
echo "== router log: lines that are not access lines of 200s"
grep -v '" 200 ' /tmp/soak/router.log | grep -v "Running on\|Starting\|Shutting\|Finished server" | head -20
echo "tracebacks: $(grep -c Traceback /tmp/soak/router.log)"
echo "== done $(date)"

-- wrk: POST /payments, each request with an Idempotency-Key never sent before.
-- wrk.lua's argument: a prefix unique to the run.
local threads = 0
function setup(thread)
  threads = threads + 1
  thread:set("tid", threads)
end
local prefix, n = "", 0
function init(args)
  prefix = (args[1] or "run") .. "-" .. tid .. "-"
end
function request()
  n = n + 1
  return wrk.format("POST", "/payments", {
    ["Content-Type"] = "application/json", ["Authorization"] = "Bearer bench",
    ["Idempotency-Key"] = prefix .. n }, '{"amount":1}')
end

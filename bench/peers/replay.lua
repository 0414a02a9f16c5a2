-- wrk: POST /payments, every request with the same Idempotency-Key (args[1]),
-- whose first request the runner sent before: every answer is a replay.
local key
function init(args)
  key = args[1]
end
function request()
  return wrk.format("POST", "/payments", {
    ["Content-Type"] = "application/json", ["Authorization"] = "Bearer bench",
    ["Idempotency-Key"] = key }, '{"amount":1}')
end

package sharedstate

import "github.com/redis/go-redis/v9"

// checkScript decides one request in one round trip, atomically (Redis runs a script alone):
// its key's concurrency slot, then its rate, then the bindings of its sessions. Time is the
// server's (TIME), so replicas whose clocks disagree still share one schedule.
//
// The rate is GCRA (the generic cell rate algorithm): the key holds its theoretical arrival
// time (tat), when the next request would be due at exactly the rate. A request is let in when
// now is no more than burst-1 intervals before that time, and moves it one interval on; the
// key expires when the schedule has caught up with now, when it would start afresh anyway.
// One number per key, and Retry-After is exact.
//
// The slots are a sorted set of members scored by their expiry: the expired ones (their
// replica stopped refreshing them) are dropped before counting. A request refused by either
// limit takes nothing from the other.
//
// KEYS[1] the rate key, KEYS[2] the slot set, KEYS[3..] the session hashes.
// ARGV[1] the rate's interval in µs (0: no rate), ARGV[2] the burst, ARGV[3] the most slots
// (0: none), ARGV[4] the slot's member, ARGV[5] the slot's TTL in ms.
// The answer: {allowed 1|0, reason, retry after µs, {each session's HGETALL}}.
var checkScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local interval = tonumber(ARGV[1])
local burst = tonumber(ARGV[2])
local maxc = tonumber(ARGV[3])
local ttl = tonumber(ARGV[5])
local bindings = {}
for i = 3, #KEYS do
	bindings[#bindings + 1] = redis.call('HGETALL', KEYS[i])
end
if maxc > 0 then
	redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
	if redis.call('ZCARD', KEYS[2]) >= maxc then
		return {0, 'concurrency', 0, bindings}
	end
end
if interval > 0 then
	local tat = tonumber(redis.call('GET', KEYS[1])) or now
	if tat < now then
		tat = now
	end
	local allow_at = tat - (burst - 1) * interval
	if now < allow_at then
		return {0, 'rate', allow_at - now, bindings}
	end
	local new_tat = tat + interval
	redis.call('SET', KEYS[1], new_tat, 'PX', math.ceil((new_tat - now) / 1000))
end
if maxc > 0 then
	redis.call('ZADD', KEYS[2], now + ttl * 1000, ARGV[4])
	redis.call('PEXPIRE', KEYS[2], ttl)
end
return {1, '', 0, bindings}
`)

// refreshScript moves the expiry of a replica's slots a TTL past now, adding the ones Redis
// lost (a restart, or an expiry while the replica could not reach it).
//
// KEYS[i] a slot set, ARGV[1] the TTL in ms, ARGV[i+1] the member of KEYS[i].
var refreshScript = redis.NewScript(`
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000000 + tonumber(t[2])
local ttl = tonumber(ARGV[1])
for i = 1, #KEYS do
	redis.call('ZADD', KEYS[i], now + ttl * 1000, ARGV[i + 1])
	redis.call('PEXPIRE', KEYS[i], ttl)
end
return #KEYS
`)

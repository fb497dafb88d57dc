// Package routerconfig is the router's configuration: the engines of each role (prefill,
// decode) and how to reach them, the policy each pool picks by and its settings, health
// checks, ejection, the wait queue, the KV events and tokenizers the cache-aware policies
// read, with each key's default stated once (the Default constants) and every check in one
// place ([Config.Validate]). It also names the policies config may use and what each needs
// ([Policies]), and what the router is given to work with: the engine kinds
// ([EngineCatalog]), a DNS resolver for discover entries, and tokenizers.
//
// The keys, with the defaults [Config.Validate] applies:
//
//	backends:
//	  - name: decode-0          # default: the URL's host:port (role-host:port for a URL in both roles)
//	    url: http://10.0.0.2:8000
//	    role: decode            # prefill | decode (required)
//	    weight: 1
//	    max_inflight: 256       # 0 means the default
//	    engine: vllm            # a kind of the catalog given (cmd/proxy: vllm, vllm-legacy, sim, sglang, mooncake)
//	    kv_hold_timeout: 480s   # the engine's own hold timeout; engine default
//	    api_key: ""             # the engine's own key, sent as Authorization: Bearer
//	    api_key_env: ""         # or the name of a variable that holds it
//	    tls_ca_file: ""         # https only: PEM CAs to trust instead of the system roots
//	    tls_server_name: ""     # https only: name to verify instead of the URL's host
//	    tls_insecure_skip_verify: false  # https only: verify nothing (tests; logged)
//	    kv_events_endpoint: ""  # the engine's KV events PUB to dial, tcp://10.0.0.2:5557
//	    kv_events_replay_endpoint: ""    # its replay ROUTER, tcp://10.0.0.2:5558: a gap is replayed
//	  - name: prefill           # a pool: one backend per A/AAAA record, "prefill/10.0.0.5:8100"
//	    url: http://vllm-prefill.ns.svc.cluster.local:8100   # e.g. a headless Service
//	    discover: dns           # empty: the url is one engine
//	    refresh: 5s             # resolved again this often; a failed lookup keeps the last set
//	    role: prefill           # every other key applies to each discovered backend
//	prefill_policy: least_inflight  # least_inflight | round_robin | power_of_two | prefix_affinity | least_loaded | cache_aware | precise_cache_aware
//	decode_policy: least_inflight
//	prefix_tokens: 256          # prefix_affinity hashes the first 4*prefix_tokens bytes; placement's key
//	cache_aware:                # cache_aware and precise_cache_aware: a request goes where its prefill costs least
//	  prefill_tokens_per_second: 10000  # an engine's rate until the proxy has learned it
//	  prefill_overhead: 10ms    # a prefill's fixed part, until learned
//	  decode_cost_tokens: 16    # what a request decoding on an engine weighs, in prefill tokens
//	  temperature: 0s           # positive: draw among near-equal costs
//	  tree_ttl: 2m              # routed text counts as cached this long
//	  balance_abs_threshold: 64 # out of balance: most minus least loaded above this,
//	  balance_rel_threshold: 1.5  # and most above this times the least: the least loaded wins
//	  max_tree_bytes: 67108864  # bound of each pool's tree of routed text
//	kv_events:                  # precise_cache_aware's source
//	  listen: ""                # tcp://*:5557: a SUB engines dial, topic kv@<url host:port>@<model>; read at start
//	  stale_after: 60s          # an engine silent longer is scored by the routed text
//	  replay_timeout: 1s
//	  max_blocks_per_backend: 1048576
//	tokenizer: engine           # precise_cache_aware tokenizes with an engine's POST /tokenize
//	tokenizers:                 # but these models in the proxy, once an engine agrees; read at start
//	  llama-3-8b: {file: /models/llama-3-8b/tokenizer.json, chat_template: /models/llama-3-8b/tokenizer_config.json}
//	tokenize_timeout: 1s
//	tokenize_max_tokens: 131072 # a prompt of more is routed by its text, tokenized no further
//	block_size: 16              # for events that give none; read at start
//	scrape_interval: 1s         # least_loaded, cache_aware, precise_cache_aware read /metrics this often
//	bounded_load_factor: 1.25   # c of bounded loads: placement, prefix_affinity; at least 1
//	health:
//	  interval: 5s              # 0 or negative disables active checks
//	  timeout: 2s
//	  unhealthy_threshold: 2    # a check or call refused at connect marks it down at once
//	  healthy_threshold: 1
//	  path: /health
//	ejection:
//	  consecutive_failures: 3   # negative disables passive ejection
//	  base_backoff: 5s          # one health.interval (at least that); 5s with checks off
//	  max_backoff: 30s          # or base_backoff if longer
//	queue:
//	  size: 1024                # per role; negative disables waiting
//	  timeout: 10s
package routerconfig

// Package sim owns a simulated vLLM-like engine for disaggregated
// prefill/decode: a real HTTP server with an OpenAI-shaped API, a KV block
// pool, a FIFO queue and a step loop with vLLM's NixlConnector semantics for
// holding, pulling, notifying and expiring KV blocks, races included. The
// proxy's tests, CI and `go run ./cmd/proxy` (its embedded default) use it.
//
// With Config.Protocol "sglang" the engine is an SGLang prefiller or decoder
// instead: both legs of a request at once, paired by a bootstrap room on the
// prefiller's bootstrap server, GET /server_info, and SGLang's
// POST /abort_request (rid prefix, admin key). sglang.go describes it.
//
// With Config.Protocol "mooncake" (--protocol mooncake) the engine is a vLLM
// prefiller or decoder with the MooncakeConnector (mooncake.go): both legs
// at once, paired by kv_transfer_params.transfer_id; the prefiller's
// bootstrap server (--bootstrap-port) answers GET /query with each data
// parallel rank's engine id ({"0": {"engine_id","host","port","dp_rank",
// "tp_size"}}), holds a finished prefill until a decoder pulled it or
// KVHoldTimeout passes (--kv-hold-timeout; 480s, vLLM's
// VLLM_MOONCAKE_ABORT_REQUEST_TIMEOUT, for `proxy sim --protocol mooncake`
// unless given), and answers the prefill leg as soon as the prefill is done.
// A decoder waits for its transfer's prefill up to WaitingTimeout
// (--waiting-timeout; /debug/kv transfers_waiting), pulls what its prefix
// cache lacks (--kv-transfer-time per block), and when the prefiller cannot
// give the KV fails with a 500 kv_transfer_failed or recomputes
// (--kv-load-failure-policy fail|recompute; kv_load_failures_total). No
// heartbeats, no /abort_request: an abort is a closed connection. Older
// vLLM's bootstrap_server_host/bootstrap_server_port params are a 400.
//
// # Data parallel ranks
//
// With DataParallelSize N > 1 (--data-parallel-size) one server fronts N
// ranks (dp.go), each its own scheduler, KV pool and engine id (rank r > 0:
// EngineID + "-dp<r>" when EngineID is set), whatever the protocol. The
// header X-data-parallel-rank picks the rank of a completion (and of
// /abort_request); absent it is rank 0, out of range a 400
// invalid_data_parallel_rank. A vLLM prefill's kv_transfer_params name its
// rank's engine id, and the pull, notify and heartbeat calls, which name it
// too, reach that rank on the same port; a decode goes to the decoder's rank
// 0 unless it carries the header. An SGLang room belongs to rank room % N (as
// SGLang's decoder picks the prefiller's rank), its prefill leg elsewhere is
// a 400. Rank r publishes its KV events with rank DataParallelRank + r on
// the endpoints' ports + that. GET /debug/kv keeps its sums over the ranks
// and adds ranks: [{rank, engine_id, requests_total, blocks_total,
// blocks_free, blocks_held, blocks_in_use, held_requests, running_requests,
// waiting_requests, holds_total, expired_total, kv_blocks_pulled_total,
// transfers_waiting}] (one entry without data parallelism); GET /metrics
// reports the sums.
//
// The rest of this comment is the vllm protocol, the default.
//
// # Requests
//
// POST /v1/completions and POST /v1/chat/completions take vLLM-shaped bodies
// (prompt or messages, max_tokens, max_completion_tokens, min_tokens,
// ignore_eos, stream, stream_options.include_usage, kv_transfer_params) and
// answer like vLLM, streaming (SSE, ending with "data: [DONE]") or not. The
// request id is the X-Request-Id header (generated when absent), echoed in
// the response header; response ids are "cmpl-<rid>" / "chatcmpl-<rid>".
// Config.Model lists the served model names (--model a,b; the first is the
// default, what a request naming none gets) and Config.LoRAModules adapters
// (--lora-modules name=path), all listed by /v1/models, the adapters with the
// first model as parent; a request naming another model gets vLLM's 404
// (models.go). A body's priority (lower first) orders the waiting queue with
// Config.SchedulingPolicy "priority" and is vLLM's 400 otherwise, unless 0;
// /debug/kv priorities counts requests per priority.
//
// POST /v1/responses is the Responses API on the same path (responses.go):
// rendered as a chat, P/D as a chat on every protocol, streamed as the
// Responses API's typed events without [DONE], stored for
// GET /v1/responses/{id} and previous_response_id. POST /v1/messages is
// Anthropic's Messages API on the same path (messages.go), as vLLM serves
// it: the system prompt and messages rendered as the chat they stand for
// (the same prompt tokens as that chat completion), max_tokens required,
// kv_transfer_params making a prefill or a decode as on chat, streamed as
// message_start, content_block_start, content_block_delta,
// content_block_stop, message_delta and message_stop (no ping, no [DONE]),
// errors in Anthropic's shape; POST /v1/messages/count_tokens counts that
// prompt. Under the sglang protocol both are SGLang's, served aggregated
// whatever bootstrap fields come. POST /inference/v1/generate is vLLM's
// token-in route (generate.go): the completion of its token_ids, its
// sampling_params read as a completion's members, kv_transfer_params making a
// prefill or a decode, token ids answered without text, one sample per
// request; SGLang has none. vLLM's pooling-style
// routes (/v1/embeddings, /pooling, /v1/score, /score, /v1/rerank, /rerank,
// /v2/rerank, /detokenize, /v1/audio/transcriptions) answer deterministic
// values in vLLM's shapes, cost simulated time and stop when their client
// leaves (pooling.go).
//
// Prompts are tokenized by the sim's own tokenizer (tokenizer.go): real,
// deterministic ids, stable under extension at word ends; chat rendered
// through one fixed ChatML template. With Config.Tokenizer (--tokenizer)
// they are tokenized by a Hugging Face tokenizer.json instead (a prompt with
// its post-processor's tokens, a chat as its ChatML text), so that a proxy
// reading the same file tokenizes as the engine does. A completions prompt given as token
// ids (a list of ids, or a list of such lists: one prompt each) is used as
// it is, for the prefix cache and for the tokens generated from it; an id
// past the vocabulary (50000 ids) is a 400. POST /tokenize answers vLLM's {"count","max_model_len","tokens"}
// for {"prompt"} or {"messages","add_generation_prompt"}. A prompt needing
// more blocks than the pool has, or longer than MaxModelLen, is a 400.
//
// # Prefix caching and KV events
//
// The block pool is also a prefix cache, as vLLM V1's (blocks.go): a
// prompt's full blocks are cached under chained block hashes once computed
// (or pulled), a request reuses every leading cached block (short of its
// last token) and computes only the rest, PrefillTime + PrefillPerToken per
// uncached token; cached blocks nobody references count as free and are
// evicted least recently used first. Only prompt blocks are cached: vLLM
// caches generated tokens' blocks too, but the sim's output words do not
// tokenize back to the ids it generated, so a next turn could not hit them.
// A decoder given kv_transfer_params
// pulls only the remote blocks its own cache lacks, KVTransferTime each,
// and caches what it pulled. Answers carry
// usage.prompt_tokens_details.cached_tokens; /debug/kv cached_blocks,
// prefix_cache_queries_total, prefix_cache_hits_total and
// kv_blocks_pulled_total; /metrics vllm:prefix_cache_queries_total and
// vllm:prefix_cache_hits_total. DisablePrefixCache turns it off. With
// KVEventsEndpoint set, BlockStored, BlockRemoved and AllBlocksCleared are
// published over ZMQ in vLLM's wire format, with an optional replay socket
// (kvevents.go). The SGLang protocol shares all of it.
//
// Blocks are keyed as vLLM keys them beyond their tokens: a LoRA adapter's
// requests by its name in every block, a request's cache_salt in its first,
// so that another adapter or salt never reuses them; the events carry
// lora_name, lora_id, extra_keys and the KV cache group. SlidingWindow adds a
// hybrid model's sliding-window group (window.go), which narrows a reused
// prefix to an end its window blocks reach.
//
// # CPU tier
//
// CPUOffloadBlocks adds a CPU tier, as vLLM's OffloadingConnector with a CPU
// backend (cputier.go): a block the GPU pool evicts moves there, least
// recently used dropped when it is full, and a prompt's leading blocks found
// there (after those on the GPU) are reloaded, CPUReloadPerBlock each, instead
// of computed; they are cached on the GPU again when the prompt is done, and
// keep their CPU copy. (vLLM's connector writes blocks to CPU as they are
// computed; the sim copies them when the GPU evicts them, which leaves the same
// blocks reachable.) A decode pulling its KV from a prefiller reloads nothing:
// it pulls what its GPU cache lacks. KV events carry medium "CPU" for the
// tier's blocks (kvevents.go). Answers count the reloaded tokens in
// cached_tokens, as vLLM counts a connector's; /debug/kv splits a prompt into
// prefix_cache_hits_total (GPU), external_prefix_cache_hits_total (reloaded)
// and prompt_tokens_computed_total, /metrics as vllm:prefix_cache_hits_total,
// vllm:external_prefix_cache_hits_total and
// pdproxy_sim_prompt_tokens_computed_total.
//
// A body is rejected in two stages, as vLLM does. Malformed JSON, wrong
// field types and missing prompts fail first, before vLLM's handler. Bad
// values (max_tokens < 1, n, min_tokens, a prompt too long) fail in its
// serving layer: a decode rejected there notifies its prefiller first, so
// that the prefiller frees the blocks it holds for it (vLLM #41269).
//
// Output token i is the word " tok<k>", k its token id in [0, 50000). By
// default k is a hash of (Seed, request id, i), so engines with the same
// seed give a request id the same answer. A request with temperature 0
// (greedy) or a seed gets its tokens from its prefix instead: token i is a
// function of the model name, the seed (greedy ignores it) and every token
// id before it, the prompt's then the ones generated so far. Any engine
// serving the model then answers a prompt made of another request's prompt
// ids and its first m generated ids with that request's tokens m, m+1, ...,
// EOS included: a continuation on another decoder is token-exact (real
// vLLM is so for greedy requests only; a seeded sample restarts its
// generator). Without ignore_eos, token i (i >= min_tokens) is an EOS (id
// 0) with probability 1/256, decided by the same hash or prefix: the
// request then ends with finish_reason "stop" and that token, counted in
// usage and listed in token_ids, has no text. With ignore_eos a request
// yields exactly max_tokens tokens (default 16).
//
// return_token_ids: true adds vLLM's (0.10.2+) token id fields: completions
// put token_ids (the generated ids) and prompt_token_ids on each choice,
// chat puts token_ids on each choice and prompt_token_ids (the rendered
// template's ids) at the top level. A stream's chunks carry their new ids
// in token_ids ([] when a chunk has none; chat's role chunks none at all)
// and the prompt's ids on the first chunk only (completions: each choice's
// first). Without the flag none of these fields appear; vLLM writes them
// as null. POST /v1/responses has no such flag and answers as before (a
// greedy one gets its tokens from its prefix too).
//
// # Prefill / decode
//
// A body with kv_transfer_params.do_remote_decode=true is a prefill: it takes
// ceil(prompt_tokens/block_size) blocks, waits PrefillTime (+PrefillPerToken
// per uncached prompt token), emits one token, holds its blocks whether it ended
// length-capped or on EOS (FINISHED_STOPPED, as vLLM does since 2026), and
// answers a top-level kv_transfer_params object (do_remote_prefill,
// remote_block_ids, remote_engine_id, remote_request_id, remote_host and
// remote_port of the connection it came in on, tp_size, and 2026's
// remote_num_tokens, remote_blocks_expiry_time, transfer_mode "read",
// dcp_size 1, pp_size 1). It lists all its blocks, the partial last one
// too, so remote_block_ids is never empty here; vLLM lists full blocks only.
// An aborted prefill holds nothing and answers kv_transfer_params null.
//
// A body with kv_transfer_params.do_remote_prefill=true is a decode: it takes
// its own blocks, pulls the prefiller's (see kvtransfer.go for the /kv/pull
// and /kv/notify protocol), notifies the prefiller, which frees at its next
// step, then decodes. A pull of blocks no longer held fails the decode with a
// 500 kv_transfer_failed error, never a 200. A decode that ends before its
// pull (client gone, abort, queued or not: vLLM #19223) still notifies the
// prefiller. Fields it does not
// use are ignored; empty or null remote_block_ids mean nothing to read: the
// decode computes the prompt itself and neither pulls, notifies nor renews.
// A decoder's first read from each prefiller waits NIXLHandshakeDelay for
// the NIXL handshake (vLLM #46240), its blocks allocated: an abort then is
// an abort during the transfer.
//
// A hold is a lease (vLLM PR #41383): it lasts KVHoldTimeout (default 30s)
// from the prefill's end, and a decoder that has the request queued or
// pulling renews it to now+KVHoldTimeout every KVHeartbeatInterval (default
// 5s) with POST /kv/heartbeat (see heartbeat.go). A hold is freed exactly
// once: by the notification, by an explicit POST /abort_request {"rid":".."},
// or when its lease runs out (expired_total, and
// vllm:nixl_num_kv_expired_reqs_total on /metrics). Aborts, notifications
// and heartbeats that arrive late (request finished, expired or unknown) are
// logged, counted in late_events_total and otherwise ignored; an abort caused
// by a client disconnect never frees a hold (vLLM's abort-after-finish no-op).
// Events are queued and applied at step boundaries, as in vLLM's scheduler.
//
// # Requests a P/D pair cannot serve safely
//
// A prefill with n > 1 or best_of, or with several prompts, runs one
// request per (prompt, sample), each holding its own blocks, and answers
// kv_transfer_params for the first only (X-Request-Id); the others' holds
// are invisible and end with their leases (vLLM #38900, #54707; see
// fanout.go). A proxy sends such requests decode-only, without
// kv_transfer_params: the sim then serves them as vLLM does, one request per
// (prompt, sample) computing its prompt in blocks of its own, every choice
// in one answer (index prompt*n+sample), streamed interleaved or whole (see
// choices.go); prompt_logprobs and echo with logprobs are served too. A
// decode with kv_transfer_params still answers n != 1, best_of and prompt
// arrays with a 400. A decode with kv_transfer_params that asks for
// prompt_logprobs, or echo with logprobs, crashes the engine (vLLM #50792):
// it and every request the engine has fail with a 500 engine_dead, holds
// vanish, no prefiller is notified or heartbeated any more,
// engine_crashes_total counts it, and the engine serves again at once.
//
// # Other endpoints
//
// GET /health, GET /live, GET /v1/models, GET /server_info (and /get_server_info:
// disaggregation_mode "null" for the vllm protocol), GET /debug/kv (KVStats
// as JSON: the pool, requests, holds_total, remote_prefill_requests_total,
// and the SGLang rooms_waiting and rooms_held) and
// GET /metrics (the engine's own registry, one consistent snapshot per
// scrape, with a model_name label: vllm:num_requests_running (requests
// holding a running slot: prefilling, pulling or decoding),
// vllm:num_requests_waiting (submitted, waiting for blocks or a slot),
// vllm:kv_cache_usage_perc (blocks not free, held ones included, over the
// pool) and vllm:request_success_total (requests the scheduler took in, from
// every client); with the sglang protocol the same under SGLang's names,
// sglang:num_running_reqs, sglang:num_queue_reqs, sglang:token_usage and
// sglang:num_requests_total, plus sglang:num_decode_prealloc_queue_reqs
// (decodes waiting for their room); and pdproxy_sim_* counters).
//
// # Fault injection
//
// Config fields (flags) set defaults, request headers override them:
//
//	X-Sim-Fail-Status: 503   answer that status at once, OpenAI error body
//	X-Sim-Stall: 2s          delay the first response byte; the engine works
//	                         meanwhile (abortable by the client)
//	X-Sim-Close-After: N     cut the connection after N SSE events (streaming)
//	                         or N body bytes (non-streaming); 0 = before any byte
//	X-Sim-Slow-Write: 50ms   sleep before every write (abortable)
//	X-Sim-Transfer-Fail: true  the request's KV transfer fails: the decoder
//	                         answers 500 kv_transfer_failed (SGLang: the
//	                         prefiller frees the room and answers 500 too)
//	X-Sim-Die-After: N       once the request sent N tokens (0: before the
//	                         first), the whole engine dies as a crashed
//	                         process: every connection closed at once (no
//	                         [DONE], no error event), the listener gone, the
//	                         KV lost (--die-after; `proxy sim` then exits
//	                         with an error)
//
// Only an engine a Server runs (Listen, NewServer; server.go) can die: a
// bare Handler answers the header with a 400. Server.Restart brings a new,
// empty engine up on the same address, as a restarted process; SIGKILL of
// `proxy sim` is the other way to kill one.
//
// # Draining
//
// Engine.Drain(grace) drains as vLLM does on SIGTERM with
// --shutdown-timeout (drain.go): GET /health and every route but GET /live,
// GET /metrics and the /kv/* side channel answer 503
// {"error":"Server is unavailable. Please try again later."}, new
// generation requests included; the requests in flight go on until grace
// ends, and those still running then are cut (their connections closed).
// `proxy sim --shutdown-timeout D` drains for D on SIGTERM; without it (0,
// vLLM's default) the engine ends every request at once.
//
// POST /abort_request needs Authorization: Bearer <AdminAPIKey> when
// Config.AdminAPIKey is set (401 otherwise), whatever the protocol.
package sim

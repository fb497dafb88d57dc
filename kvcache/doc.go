// Package kvcache owns what the proxy believes each engine holds in its prefix cache, in two
// views:
//
//   - [Tree], the approximate view: a bounded radix tree of the text routed to each engine,
//     which needs nothing from the engines and answers "which engine was last sent the
//     longest prefix of this text";
//   - [Index], the precise view: which engine holds which KV block, built from the engines'
//     own KV events (vLLM's ZMQ format, which SGLang publishes too), fed by [Events]
//     (subscribers, decoding, replay) and looked up by a request's token ids.
//
// The index keys blocks by its own chained hash of the events' token ids, not by the
// engines' block hashes, so that an engine's hash seed and algorithm (PYTHONHASHSEED,
// sha256 or builtin) do not matter and one request hashes once for every engine. It keeps the
// map from each engine's hashes to its own keys only to apply BlockRemoved. Each block's
// entry counts its copies per tier (GPU, CPU, disk, tiers named by SetTierWeights), so that
// a match weighs a block offloaded to CPU as a reload, not as a GPU hit.
//
// The package imports nothing of the project: the router names engines by strings and
// hands it their endpoints.
package kvcache

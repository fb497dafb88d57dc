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
// sha256 or builtin) do not matter and one request hashes once for every engine. A block's
// extra keys (the LoRA, the cache_salt: what vLLM hashes a block with beyond its tokens) are
// folded into its key, and a request is matched under its Identity; a hybrid model's
// sliding-window and Mamba groups narrow what a match of its full-attention blocks credits. It is one
// table keyed by block, whose entry lists the engines holding the block with their copies per
// tier (GPU, CPU, disk, tiers named by SetTierWeights), so that one walk of a request's keys
// answers every engine (MatchAll) at a cost that grows with the engines holding the prompt,
// not with the pool, and a match weighs a block offloaded to CPU as a reload, not as a GPU
// hit. It keeps the map from each engine's hashes to its own keys only to apply BlockRemoved
// and to find the parents of later blocks.
//
// The package imports nothing of the project: the router names engines by strings and
// hands it their endpoints.
package kvcache

// Package hftok tokenizes text as a Hugging Face tokenizer.json describes it, for the
// byte-level BPE tokenizers most served models ship (GPT-2's family, Llama 3, Qwen 2 and 3),
// and renders chat messages through a model's Jinja chat template,
// so that the proxy can have a request's tokens without asking an engine.
//
// What it reads of a tokenizer.json: the BPE model (vocab, merges in either of their two
// spellings, ignore_merges), the added tokens (matched in the raw text before anything else,
// as the Rust library does), the NFC/NFD/NFKC/NFKD, Lowercase and Sequence normalizers, the
// ByteLevel, Split (a regular expression, Isolated or Removed) and Sequence pre-tokenizers,
// and the ByteLevel, TemplateProcessing and Sequence post-processors (the tokens a prompt
// gets around it, such as Llama 3's <|begin_of_text|>). Anything else (a WordPiece or Unigram
// model, a SentencePiece-style BPE with byte fallback, a Metaspace pre-tokenizer, dropout,
// an added token with lstrip, rstrip or single_word) is refused by Load with an error naming
// it: a tokenizer that tokenizes a little differently from the engine is worse than none, as
// every prompt would miss the cache it has.
//
// Split's patterns use lookahead, which Go's regexp lacks: they run on
// github.com/dlclark/regexp2, except Llama 3's and Qwen 2's (llama3.go) and the GPT-2 pattern
// of a ByteLevel pre-tokenizer with use_regex (pretok.go), matched by hand ten times faster
// and held to regexp2 by fuzz tests.
//
// A Tokenizer is safe for concurrent use. Its callers share two caches of fixed bounds
// (cache.go): the tokens of words, and of segments, the text between two added tokens, which
// Encode tokenizes on its own, so that a chat's system prompt and earlier messages, rendered
// again on each of its turns, are looked up rather than tokenized.
package hftok

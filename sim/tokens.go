package sim

import (
	"hash/fnv"
	"strconv"
)

// Token source. A request has one of two:
//
// By request id (the default): token i is the word " tok<k>", k in
// [0,50000) its id, and token i is an EOS with probability 1/256; both come
// from a hash of (Seed, request id, i), so a request id always yields the
// same answer on every engine with the same seed: a decoder's first token
// equals its prefiller's.
//
// By prefix (a greedy request, temperature 0, or one with a seed): token i
// is a function of the model name, the seed (unless greedy: greedy
// sampling ignores it) and every token id before it, the prompt's and the
// ones generated so far, folded into one 64-bit state. A prompt that is
// another request's prompt ids followed by its first m generated ids then
// generates that request's tokens m, m+1, ..., EOS included, on any engine
// serving the model: a continuation on another decoder is token-exact.
// Real vLLM is so for greedy requests only; a seeded sample restarts its
// generator with each request.
//
// Token id k reads as " tok<k>"; the EOS is tokenEOS and has no text.
const eosOneIn = 256

func ridHash(seed int64, rid string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(rid))
	return h.Sum64() ^ mix64(uint64(seed))
}

// mix64 is splitmix64's finalizer: cheap and well spread.
func mix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

// tokenID is the id of token i of the request whose ridHash is h.
func tokenID(h uint64, i int) uint32 {
	return uint32(mix64(h^uint64(i)*2) % vocabSize)
}

func tokenText(h uint64, i int) string { return tokenWord(tokenID(h, i)) }

func tokenIsEOS(h uint64, i int) bool {
	return mix64(h^(uint64(i)*2+1))%eosOneIn == 0
}

// tokenWord is the text of a generated token id; an EOS has none.
func tokenWord(id uint32) string {
	return " tok" + strconv.FormatUint(uint64(id), 10)
}

// prefixState is the state of the by-prefix source before its first
// token: the model, the seed when seeded, then every prompt token folded in.
func prefixState(model string, seeded bool, seed int64, prompt []uint32) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(model))
	s := mix64(h.Sum64())
	if seeded {
		s = mix64(s ^ mix64(uint64(seed)))
	}
	for _, id := range prompt {
		s = foldToken(s, id)
	}
	return s
}

// foldToken is the by-prefix state once id follows it.
func foldToken(s uint64, id uint32) uint64 {
	return mix64(s*0x100000001b3 ^ uint64(id))
}

// prefixToken is the token a by-prefix state generates, and whether that
// state ends the answer with an EOS (where an EOS is allowed).
func prefixToken(s uint64) (id uint32, eos bool) {
	return firstTextToken + uint32(mix64(s^0x5bd1e995)%(vocabSize-firstTextToken)), mix64(s^0x27d4eb2f165667c5)%eosOneIn == 0
}

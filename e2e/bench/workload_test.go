package bench

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"strings"

	"github.com/pdproxy/pdproxy/sim"
)

// chatWorkload is a multi-turn chat workload for prefix-cache routing: groups of users
// whose conversations all start with their group's long system prompt, each user's turn
// extending the previous turn (its question, the assistant's reply, the next question).
// The replies are the workload's, not the engine's, so that every run sends the same
// prompts and the oracle can be computed without an engine. Everything comes from a seed.
type chatWorkload struct {
	groups, users, turns int
	systems              []string     // per group
	questions            [][][]string // [group][user][turn]
	replies              [][][]string // [group][user][turn]
	order                [][]turnRef  // waves: turn t of every session, shuffled
}

// turnRef names one request of the workload.
type turnRef struct{ group, user, turn int }

// workloadShape sizes a chatWorkload.
type workloadShape struct {
	groups, users, turns int
	systemWords          int // words of each group's system prompt
	questionWords        int
	replyWords           int
	seed                 uint64
}

// defaultShape is the routing measurements' workload: 12 groups x 4 users x 3 turns, a
// system prompt of about 1,000 tokens per group, turns of about 90 tokens.
var defaultShape = workloadShape{groups: 12, users: 4, turns: 3, systemWords: 500, questionWords: 25, replyWords: 20, seed: 42}

func newChatWorkload(s workloadShape) *chatWorkload {
	rng := rand.New(rand.NewPCG(s.seed, 0x9e3779b97f4a7c15))
	words := func(n int) string {
		var b strings.Builder
		for i := range n {
			if i > 0 {
				b.WriteByte(' ')
			}
			for range 3 + rng.IntN(7) {
				b.WriteByte(byte('a' + rng.IntN(26)))
			}
		}
		return b.String()
	}
	w := &chatWorkload{groups: s.groups, users: s.users, turns: s.turns}
	for g := range s.groups {
		w.systems = append(w.systems, fmt.Sprintf("You are assistant %d. ", g)+words(s.systemWords))
		var qs, rs [][]string
		for range s.users {
			var q, r []string
			for range s.turns {
				q = append(q, words(s.questionWords))
				r = append(r, words(s.replyWords))
			}
			qs, rs = append(qs, q), append(rs, r)
		}
		w.questions, w.replies = append(w.questions, qs), append(w.replies, rs)
	}
	for t := range s.turns {
		var wave []turnRef
		for g := range s.groups {
			for u := range s.users {
				wave = append(wave, turnRef{g, u, t})
			}
		}
		rng.Shuffle(len(wave), func(i, j int) { wave[i], wave[j] = wave[j], wave[i] })
		w.order = append(w.order, wave)
	}
	return w
}

// messages is the conversation of one request: the system prompt, the earlier turns with
// their replies, the turn's question.
func (w *chatWorkload) messages(r turnRef) []sim.ChatMessage {
	m := []sim.ChatMessage{{Role: "system", Content: w.systems[r.group]}}
	for t := 0; t < r.turn; t++ {
		m = append(m, sim.ChatMessage{Role: "user", Content: w.questions[r.group][r.user][t]},
			sim.ChatMessage{Role: "assistant", Content: w.replies[r.group][r.user][t]})
	}
	return append(m, sim.ChatMessage{Role: "user", Content: w.questions[r.group][r.user][r.turn]})
}

// body is the chat completion request of one turn: a short answer, not streamed.
func (w *chatWorkload) body(r turnRef) []byte { return w.request(r, false) }

// streamBody is the same request, streamed.
func (w *chatWorkload) streamBody(r turnRef) []byte { return w.request(r, true) }

func (w *chatWorkload) request(r turnRef, stream bool) []byte {
	type msg struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}
	var ms []msg
	for _, m := range w.messages(r) {
		ms = append(ms, msg{m.Role, m.Content})
	}
	b, _ := json.Marshal(map[string]any{"model": "sim", "messages": ms, "max_tokens": 4, "ignore_eos": true, "stream": stream})
	return b
}

// systemBlocks is the full blocks of each group's system prompt (its rendered message).
func (w *chatWorkload) systemBlocks(blockSize int) int {
	n := 0
	for g := range w.groups {
		n += len(sim.TokenizeChat([]sim.ChatMessage{{Role: "system", Content: w.systems[g]}}, false)) / blockSize
	}
	return n
}

// maxBlocks is the blocks of the workload's longest request.
func (w *chatWorkload) maxBlocks(blockSize int) int {
	n := 0
	for _, wave := range w.order {
		for _, r := range wave {
			n = max(n, (len(sim.TokenizeChat(w.messages(r), true))+blockSize-1)/blockSize)
		}
	}
	return n
}

// oracle is the prefix-cache hit ratio one engine with an unbounded cache reaches on the
// workload, its requests served one at a time in the workload's order: each request finds
// cached every leading full block an earlier one computed (short of its last token, which
// an engine always computes), as the engine counts hits (tokens) over queries (tokens).
func (w *chatWorkload) oracle(blockSize int) (hits, queries int) {
	cached := map[uint64]bool{}
	for _, wave := range w.order {
		for _, r := range wave {
			toks := sim.TokenizeChat(w.messages(r), true)
			keys := prefixKeys(toks, blockSize)
			hit := 0
			for hit < (len(toks)-1)/blockSize && cached[keys[hit]] {
				hit++
			}
			hits += hit * blockSize
			queries += len(toks)
			for _, k := range keys {
				cached[k] = true
			}
		}
	}
	return hits, queries
}

// prefixKeys names each full block of toks by its whole prefix: a hash chaining the
// previous block's key with the block's tokens (the oracle's own, not the engine's).
func prefixKeys(toks []uint32, blockSize int) []uint64 {
	keys := make([]uint64, len(toks)/blockSize)
	h := fnv.New64a()
	var buf [8]byte
	for i := range keys {
		h.Reset()
		if i > 0 {
			binary.LittleEndian.PutUint64(buf[:], keys[i-1])
			h.Write(buf[:])
		}
		for _, t := range toks[i*blockSize : (i+1)*blockSize] {
			binary.LittleEndian.PutUint32(buf[:4], t)
			h.Write(buf[:4])
		}
		keys[i] = h.Sum64()
	}
	return keys
}

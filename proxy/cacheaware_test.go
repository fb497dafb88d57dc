package proxy

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"net/http"
	"strings"
	"testing"

	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// chatTurns is the messages array of a session's first n turns: a system prompt its group
// shares, then the user's questions and the answers it got.
func chatTurns(system, user string, n int) string {
	msgs := []map[string]string{{"role": "system", "content": system}}
	for i := range n {
		msgs = append(msgs, map[string]string{"role": "user", "content": fmt.Sprintf("%s, question %d", user, i)})
		if i < n-1 {
			msgs = append(msgs, map[string]string{"role": "assistant", "content": fmt.Sprintf("answer %d to %s", i, user)})
		}
	}
	b, _ := json.Marshal(msgs)
	return string(b)
}

// decoderOf is the decoder the proxy chose for a request, as the answer's log would say: the
// engine that got it.
func decoderOf(t *testing.T, ds []*fakeEngine, marker string) int {
	t.Helper()
	for i, d := range ds {
		for _, g := range d.generations() {
			if strings.Contains(string(g.Body), marker) {
				return i
			}
		}
	}
	t.Fatalf("no decoder got %q", marker)
	return -1
}

func TestCacheAwareSendsASessionsNextTurnWhereItsConversationIs(t *testing.T) {
	var ds []*fakeEngine
	var bs []routerconfig.BackendConfig
	for i := range 4 {
		d := newEngine(t, vllmDecode)
		ds = append(ds, d)
		bs = append(bs, decoder(fmt.Sprintf("d%d", i), d.URL()))
	}
	h := newHarness(t, Config{}, routerconfig.Config{Backends: bs, DecodePolicy: routerconfig.PolicyCacheAware})
	// Four groups with a long system prompt each, two users in each: a session's turns
	// must stay on the engine that has its conversation, whatever the others do.
	// Each turn takes the sessions in another order, so that no rotation of the decoders
	// could put a session back where it was by chance.
	first := map[string]int{}
	rng := rand.New(rand.NewPCG(1, 2))
	for turn := 1; turn <= 3; turn++ {
		for _, s := range rng.Perm(8) {
			g, u := s/2, s%2
			system := fmt.Sprintf("group %d: %s", g, strings.Repeat(fmt.Sprintf("you are assistant number %d. ", g), 40))
			{
				user := fmt.Sprintf("user-%d-%d", g, u)
				marker := fmt.Sprintf("%s, question %d", user, turn-1)
				resp, body := h.post("/v1/chat/completions", `{"model":"m","messages":`+chatTurns(system, user, turn)+`}`)
				if resp.StatusCode != http.StatusOK {
					t.Fatalf("status %d: %s", resp.StatusCode, body)
				}
				got := decoderOf(t, ds, marker)
				if turn == 1 {
					first[user] = got
				} else if got != first[user] {
					t.Errorf("%s's turn %d went to d%d, its conversation is on d%d", user, turn, got, first[user])
				}
			}
		}
	}
	used := map[int]bool{}
	for _, d := range first {
		used[d] = true
	}
	if len(used) < 2 {
		t.Errorf("every group's sessions went to one decoder (%v): four different prefixes should spread", first)
	}
}

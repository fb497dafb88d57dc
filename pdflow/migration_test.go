package pdflow

import (
	"net/http"
	"testing"

	"github.com/pdproxy/pdproxy/api"
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// The token ids are asked of the engines that report them only: an SGLang decoder, which
// cannot continue a stream, never sees return_token_ids unless its client sent it.
func TestTokenIDsAreAskedOnlyOfEnginesThatContinue(t *testing.T) {
	req, e := api.ParseCompletions([]byte(`{"model":"m","prompt":"a","stream":true}`))
	if e != nil {
		t.Fatal(e)
	}
	x := &Exchange{s: &Flow{cfg: Config{MigrationLimit: 1, MigrationMaxTokens: 100}}, Req: req}
	if e := x.PlanResume(); e != nil {
		t.Fatal(e)
	}
	for _, tc := range []struct {
		eng  engine.Engine
		want bool
	}{{engine.VLLM, true}, {engine.Mooncake, true}, {engine.Sim, true}, {engine.SGLang, false}} {
		b, err := router.NewDetached(routerconfig.BackendConfig{URL: "http://127.0.0.1:9", Role: routerconfig.RoleDecode}, tc.eng, http.DefaultClient)
		if err != nil {
			t.Fatal(err)
		}
		_, got := x.fieldsFor(b).Field("return_token_ids")
		if got != tc.want {
			t.Errorf("%s decoder asked for token ids: %v, want %v", tc.eng.Kind(), got, tc.want)
		}
	}
}

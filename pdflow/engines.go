package pdflow

import (
	"github.com/pdproxy/pdproxy/engine"
	"github.com/pdproxy/pdproxy/router"
	"github.com/pdproxy/pdproxy/router/routerconfig"
)

// engineOf is the engine a backend runs; the router carries it from config without knowing it.
func engineOf(b *router.Backend) engine.Engine { return kvEngine(b.Engine) }

// kvEngine is the engine the router carries: vLLM unless its config named another.
func kvEngine(e routerconfig.Engine) engine.Engine {
	if ke, ok := e.(engine.Engine); ok {
		return ke
	}
	return engine.VLLM
}

// canAbort reports whether b's engine has an explicit abort.
func canAbort(b *router.Backend) bool {
	_, ok := engineOf(b).(engine.Aborter)
	return ok
}

// sequential accepts the engines that serve a request as a prefill, then a decode (vLLM),
// paired those that send both legs at once (SGLang, Mooncake), and pairedWith those that
// speak the same paired protocol as e: one request never mixes the two.
func sequential(e routerconfig.Engine) bool { return !paired(e) }

func paired(e routerconfig.Engine) bool { _, p := e.(engine.Paired); return p }

func pairedWith(d routerconfig.Engine) func(routerconfig.Engine) bool {
	return func(e routerconfig.Engine) bool { return e.Kind() == d.Kind() }
}

// continuable accepts the decoders a continuation may go to: engines that continue from ids.
// (The decoders the stream left are excluded by name: hint.)
func continuable(e routerconfig.Engine) bool {
	_, ok := kvEngine(e).(engine.Continuer)
	return ok
}

// Command proxy is pdproxy: an OpenAI-compatible reverse proxy for disaggregated
// prefill/decode LLM serving. With no flags it starts a simulated prefiller and decoder
// in-process and serves on 127.0.0.1:8000; `proxy sim` runs one simulated engine alone.
package main

import (
	"context"
	"os"
	"os/signal"
	"syscall"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	code := app.Run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	os.Exit(code)
}

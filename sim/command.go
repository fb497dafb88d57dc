package sim

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
)

// DefaultListen is the address `proxy sim` listens on without --listen.
const DefaultListen = "127.0.0.1:8100"

// RunCommand implements `proxy sim [flags]`: it parses args (--listen plus
// every flag of BindFlags), listens, logs the address to stderr, serves until
// ctx is done, then shuts down gracefully and returns nil. With --help it
// prints the usage to stderr and returns flag.ErrHelp. stdout is not
// written: everything, the address included, is a log line on stderr.
func RunCommand(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("sim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	cfg := DefaultConfig()
	listen := fs.String("listen", DefaultListen, "address to listen on (port 0 picks a free port)")
	shutdownTimeout := fs.Duration("shutdown-timeout", 0, "on SIGTERM, drain as vLLM's --shutdown-timeout does: /health and new requests answer 503, in-flight requests get this long, then are cut (0: end them at once)")
	BindFlags(fs, &cfg)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: proxy sim [flags]\n\n"+
			"Runs one simulated vLLM-like engine (OpenAI API, P/D kv_transfer_params,\n"+
			"KV block pool with leases, heartbeats, notify and expiry), or with --protocol sglang\n"+
			"an SGLang prefiller or decoder (bootstrap rooms on a bootstrap server, GET /server_info,\n"+
			"POST /abort_request by rid prefix), or with --protocol mooncake a vLLM MooncakeConnector\n"+
			"prefiller or decoder (legs paired by transfer_id, GET /query on the bootstrap server).\n"+
			"--data-parallel-size N serves N ranks chosen by X-data-parallel-rank. Per-request fault headers: X-Sim-Fail-Status,\n"+
			"X-Sim-Stall, X-Sim-Close-After, X-Sim-Slow-Write, X-Sim-Transfer-Fail, X-Sim-Die-After.\n"+
			"--shutdown-timeout drains on SIGTERM as vLLM does (/health and new requests 503, in-flight ones finish).\n"+
			"Prefix caching (--prefix-cache), POST /tokenize, and KV events in vLLM's ZMQ format\n"+
			"(--kv-events-endpoint, --kv-events-replay-endpoint, --kv-events-topic, --kv-events-format).\n"+
			"POST /v1/responses (the Responses API), /v1/embeddings, /pooling, /v1/score, /v1/rerank, /detokenize and\n"+
			"/v1/audio/transcriptions in vLLM's shapes; --model a,b and --lora-modules serve several models,\n"+
			"--scheduling-policy priority orders the queue by the body's priority.\n"+
			"GET /debug/kv shows the KV pool and counters.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return err // flag.ErrHelp included: the caller exits 0 on it
	}
	if cfg.Protocol == ProtocolMooncake {
		// Mooncake's hold is a fixed 480s, not the NIXL lease the flag's
		// default is, unless the flag says otherwise.
		given := false
		fs.Visit(func(f *flag.Flag) { given = given || f.Name == "kv-hold-timeout" })
		if !given {
			cfg.KVHoldTimeout = defaultMooncakeHold
		}
	}
	if fs.NArg() > 0 {
		return fmt.Errorf("sim: unexpected arguments %q", fs.Args())
	}
	// The bootstrap server listens where the API does: decoders reach it at
	// the prefiller's host.
	host, _, err := net.SplitHostPort(*listen)
	if err != nil {
		return fmt.Errorf("sim: --listen %q: %w", *listen, err)
	}
	cfg.BootstrapHost = host
	if host == "" {
		cfg.BootstrapHost = "0.0.0.0"
	}
	logger := zap.New(zapcore.NewCore(
		zapcore.NewJSONEncoder(zap.NewProductionEncoderConfig()),
		zapcore.Lock(zapcore.AddSync(stderr)), zap.InfoLevel))
	defer func() { _ = logger.Sync() }()

	if _, err := cfg.withDefaults(); err != nil {
		return err // before listening on anything
	}
	ln, err := (&net.ListenConfig{}).Listen(ctx, "tcp", *listen)
	if err != nil {
		return fmt.Errorf("sim: listen %s: %w", *listen, err)
	}
	// After the listener: an SGLang prefiller binds its bootstrap port in New,
	// and only Run closes it.
	s, err := NewServer(cfg, ln, logger)
	if err != nil {
		return err
	}
	engine := s.Engine()
	logger.Info("sim engine listening", zap.String("addr", ln.Addr().String()),
		zap.String("engine_id", engine.ID()), zap.String("protocol", cfg.Protocol), zap.String("role", cfg.Role), zap.String("model", cfg.Model),
		zap.String("kv_events_endpoint", engine.KVEventsAddr()), zap.Strings("kv_events_endpoints", engine.KVEventsAddrs()), zap.Int("data_parallel_size", cfg.DataParallelSize),
		zap.String("kv_events_replay_endpoint", engine.KVEventsReplayAddr()))

	var died error
	select {
	case <-ctx.Done():
		// SIGTERM: vLLM's drain when --shutdown-timeout is set, then the
		// engine stops and ends what is left.
		if *shutdownTimeout > 0 {
			engine.Drain(*shutdownTimeout)
		}
	case <-s.Died():
		died = errors.New("sim: engine died (die-after fault)")
	}
	err = errors.Join(s.Close(), died)
	logger.Info("sim engine stopped", zap.String("addr", ln.Addr().String()))
	return err
}

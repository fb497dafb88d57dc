//go:build browser

package e2e

// The live view in a real browser: Debian's chromium, headless, driven over Chrome's DevTools
// protocol by chromedp. The build tag keeps `go test ./...` free of a browser; .ci/run
// installs chromium and runs these with -tags browser.

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/chromedp/chromedp"

	"github.com/pdproxy/pdproxy/cmd/proxy/app"
	"github.com/pdproxy/pdproxy/internal/testutil"
	"github.com/pdproxy/pdproxy/proxy"
	"github.com/pdproxy/pdproxy/sim"
)

// pageWait bounds every wait on what the page shows: it polls twice a second, and a busy
// machine (the race detector, a browser, engines and proxy on two cores) may be slow to draw.
const pageWait = 20 * time.Second

// browser is a headless chromium showing one page.
type browser struct {
	t   *testing.T
	ctx context.Context
}

// openBrowser starts chromium on url and stops it when the test ends. It fails, never skips,
// without chromium: the test was asked for by its build tag.
func openBrowser(t *testing.T, url string) *browser {
	t.Helper()
	path := os.Getenv("PDPROXY_CHROMIUM")
	if path == "" {
		var err error
		if path, err = exec.LookPath("chromium"); err != nil {
			t.Fatalf("this test drives Debian's chromium, which is not on PATH (apt-get install -y chromium; .ci/run installs it), or set PDPROXY_CHROMIUM: %v", err)
		}
	}
	opts := append(chromedp.DefaultExecAllocatorOptions[:],
		chromedp.ExecPath(path),
		// Tests run as root, where chromium's sandbox cannot start.
		chromedp.NoSandbox,
		chromedp.WindowSize(1280, 1000),
	)
	allocCtx, cancelAlloc := chromedp.NewExecAllocator(context.Background(), opts...)
	ctx, cancel := chromedp.NewContext(allocCtx)
	t.Cleanup(func() {
		cancel()
		cancelAlloc() // kills chromium and waits for it
	})
	// The first run starts chromium for as long as ctx lives, so it has no timeout of its own.
	if err := chromedp.Do(ctx); err != nil {
		t.Fatalf("start chromium: %v", err)
	}
	nav, cancelNav := context.WithTimeout(ctx, pageWait)
	defer cancelNav()
	if err := chromedp.Do(nav, chromedp.Navigate(url)); err != nil {
		t.Fatalf("open %s in chromium: %v", url, err)
	}
	b := &browser{t: t, ctx: ctx}
	b.waitFor("the page's first poll of its state", `document.body.dataset.polls ? "" : "no poll yet: " + document.getElementById("status").textContent`)
	return b
}

// eval runs expr in the page and returns its string value.
func (b *browser) eval(expr string) string {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, pageWait)
	defer cancel()
	out, err := chromedp.Run(ctx, chromedp.Evaluate[string](expr))
	if err != nil {
		b.t.Fatalf("evaluate %s in the page: %v", expr, err)
	}
	return out
}

// waitFor polls the page until expr, a JavaScript expression, is "" (what it waits for holds);
// otherwise expr says what the page shows instead.
func (b *browser) waitFor(what, expr string) {
	b.t.Helper()
	testutil.WaitFor(b.t, pageWait, func() (bool, string) {
		why := b.eval(expr)
		return why == "", what + ": " + why
	})
}

// screenshot saves the whole page as a PNG.
func (b *browser) screenshot(path string) {
	b.t.Helper()
	ctx, cancel := context.WithTimeout(b.ctx, pageWait)
	defer cancel()
	png, err := chromedp.Run(ctx, chromedp.FullScreenshot(100))
	if err != nil {
		b.t.Fatalf("screenshot: %v", err)
	}
	if err := os.WriteFile(path, png, 0o644); err != nil {
		b.t.Fatal(err)
	}
	b.t.Logf("screenshot of the live view: %s (%d bytes)", path, len(png))
}

// screenshotDir is where the screenshots go: PDPROXY_UI_SCREENSHOT, a directory, or the
// test's temporary one.
func screenshotDir(t *testing.T) string {
	t.Helper()
	dir := os.Getenv("PDPROXY_UI_SCREENSHOT")
	if dir == "" {
		return t.TempDir()
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	return dir
}

// JavaScript that reads what the page shows of a request, a hold and an abort, by the data
// attributes the page puts on each row. Ids here are plain: no quoting needed.
func jsRowState(section, id string) string {
	return fmt.Sprintf(`(document.querySelector('#%s tr[data-id="%s"]') || {dataset: {state: "absent"}}).dataset.state`, section, id)
}

func jsAbortStage(id string) string {
	return fmt.Sprintf(`(document.querySelector('#aborts tr[data-id="%s"]') || {dataset: {stage: "absent"}}).dataset.stage`, id)
}

// curlStream starts curl on a long stream with the given X-Request-Id, as a client would,
// and returns it once the first token came back.
func curlStream(t *testing.T, url, id string) *exec.Cmd {
	t.Helper()
	curl, err := exec.LookPath("curl")
	if err != nil {
		t.Fatalf("this test drives curl, which is not on PATH (.ci/run installs it): %v", err)
	}
	cmd := exec.Command(curl, "-N", "-sS", "-H", "X-Request-Id: "+id, url+"/v1/completions", "-d", longStream)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	go func() {
		// Reads the stream for as long as curl lives, so that it never blocks on a full pipe.
		br := bufio.NewReader(out)
		for {
			if _, err := br.ReadString('\n'); err != nil {
				return
			}
		}
	}()
	return cmd
}

func kill(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	if err := cmd.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	cmd.Wait()
}

// TestLiveViewShowsAHoldAndTwoAbortsAsTheyHappen opens the live view in chromium and watches
// two clients leave. One long stream decodes on the only decoder slot (the sims' default
// 10 ms a token); a second request is prefilled and waits for that slot with its KV held on
// the prefiller (decoder_reservation after_prefill). Killing the second curl must take its
// hold off the page and list its abort as kv_held; killing the first must take it out of
// the requests in flight and list its abort as decoding.
func TestLiveViewShowsAHoldAndTwoAbortsAsTheyHappen(t *testing.T) {
	s := startStack(t, func(c *app.Config) {
		c.Proxy.DecoderReservation = proxy.ReserveAfterPrefill
		c.Sims[1].MaxInflight = 1
		// The held request waits for the decoder for as long as the test takes.
		c.Router.Queue.Timeout = time.Minute
	})
	dir := screenshotDir(t)
	b := openBrowser(t, s.url+"/debug/ui")
	var prefiller, decoder string
	for _, bs := range s.m.Router.Backends() {
		if bs.Role == "prefill" {
			prefiller = bs.Name
		} else {
			decoder = bs.Name
		}
	}

	stream := curlStream(t, s.url, "liveview-stream")
	b.waitFor("the stream decoding", `(`+jsRowState("requests", "liveview-stream")+` === "decoding") ? "" : "liveview-stream is "+`+jsRowState("requests", "liveview-stream"))
	held := curlStream(t, s.url, "liveview-held")
	b.waitFor("the second request holding KV on "+prefiller, fmt.Sprintf(`(() => {
		const st = %s, hold = document.querySelector('#holds [data-prefill="%s"] tr[data-id="liveview-held"]');
		return st === "kv_held" && hold ? "" : "liveview-held is " + st + ", its hold " + (hold ? "shown" : "not shown");
	})()`, jsRowState("requests", "liveview-held"), prefiller))
	if got := b.eval(`document.querySelector('#backends tr[data-name="` + decoder + `"] td:nth-child(5)').textContent`); got != "1 / 1" {
		t.Errorf("%s's in flight shows %q, want 1 / 1", decoder, got)
	}
	b.screenshot(filepath.Join(dir, "liveview-holding.png"))

	kill(t, held)
	b.waitFor("the held request aborted in kv_held and its hold gone", fmt.Sprintf(`(() => {
		const st = %s, stage = %s, hold = document.querySelector('#holds tr[data-id="liveview-held"]');
		return (st === "absent" || st === "aborted") && stage === "kv_held" && !hold ? "" :
			"liveview-held is " + st + ", its abort " + stage + ", its hold " + (hold ? "still shown" : "gone");
	})()`, jsRowState("requests", "liveview-held"), jsAbortStage("liveview-held")))
	if got := b.eval(`document.querySelector('#holds [data-prefill="` + prefiller + `"]').dataset.count`); got != "0" {
		t.Errorf("%s shows %s holds after the release, want 0", prefiller, got)
	}

	kill(t, stream)
	b.waitFor("the stream aborted in decoding and out of the requests in flight", fmt.Sprintf(`(() => {
		const st = %s, stage = %s;
		return st === "absent" && stage === "decoding" ? "" : "liveview-stream is " + st + ", its abort " + stage;
	})()`, jsRowState("requests", "liveview-stream"), jsAbortStage("liveview-stream")))
	if got := b.eval(`document.querySelector('#aborts tbody tr').dataset.id`); got != "liveview-stream" {
		t.Errorf("the newest abort shown is %q, want liveview-stream", got)
	}
	b.screenshot(filepath.Join(dir, "liveview-aborted.png"))
	s.assertQuiet(5 * time.Second)
}

// TestLiveViewDuringAGiveUpStorm takes the live view's picture while 16 clients send
// requests of several kinds and leave at random moments, against the default sims with room
// for 8 streams on the decoder, reserved after the prefill, and least_loaded picking: requests
// in every stage, some waiting with their KV held, holds coming and going, the last aborts
// filling up, the engines' reported load. The page must keep up: it shows requests in flight,
// holds, the aborts piling up and an engine reporting requests running while the storm runs,
// and nothing in flight once it is over. The screenshot is the one in docs/liveview.png.
// PDPROXY_STORM=N sets the number of requests (200 by default).
func TestLiveViewDuringAGiveUpStorm(t *testing.T) {
	n := stormSize(t, "PDPROXY_STORM")
	s := startStack(t, func(c *app.Config) {
		c.Proxy.DecoderReservation = proxy.ReserveAfterPrefill
		c.Sims[1].MaxInflight = 8
		// least_loaded scrapes the engines' /metrics: the page shows the load they report.
		c.Router.PrefillPolicy, c.Router.DecodePolicy = "least_loaded", "least_loaded"
	})
	dir := screenshotDir(t)
	b := openBrowser(t, s.url+"/debug/ui")
	kinds := []stormKind{
		{"completion stream", "/v1/completions", `{"model":"sim","prompt":"%s","max_tokens":%d,"ignore_eos":true,"stream":true}`},
		{"chat stream", "/v1/chat/completions", `{"model":"sim","messages":[{"role":"user","content":"%s"}],"max_tokens":%d,"ignore_eos":true,"stream":true}`},
		{"completion", "/v1/completions", `{"model":"sim","prompt":"%s","max_tokens":%d,"ignore_eos":true}`},
		{"n=2", "/v1/completions", `{"model":"sim","prompt":"%s","max_tokens":%d,"ignore_eos":true,"n":2}`},
	}
	polls := func() int {
		n, _ := strconv.Atoi(b.eval(`document.body.dataset.polls || "0"`))
		return n
	}
	before := polls()
	done := make(chan struct{})
	var outcomes map[string]int
	go func() {
		defer close(done)
		outcomes, _ = giveUpStorm(t, s.url, kinds, n, 23)
	}()
	// The picture is taken while the storm is at its height: requests in flight, KV held for
	// some of them, and some twenty aborts already listed.
	b.waitFor("the storm on the page", `(() => {
		const inflight = document.querySelectorAll('#requests tbody tr').length, aborts = document.querySelectorAll('#aborts tbody tr').length,
			holds = document.querySelectorAll('#holds tbody tr').length;
		const scraped = [...document.querySelectorAll('#backends tbody tr td:nth-child(9)')].every((td) => td.textContent.endsWith(" ago")) &&
			[...document.querySelectorAll('#backends tbody tr td:nth-child(7)')].some((td) => Number(td.textContent) > 0);
		return inflight >= 4 && holds >= 1 && aborts >= 20 && scraped ? "" :
			inflight + " in flight, " + holds + " holds, " + aborts + " aborts shown, engines' load " + (scraped ? "shown" : "not shown");
	})()`)
	b.screenshot(filepath.Join(dir, "liveview-storm.png"))
	<-done
	logOutcomes(t, n, outcomes)
	if got := polls() - before; got < 3 {
		t.Errorf("the page polled %d times during the storm, want several", got)
	}
	s.assertQuiet(5 * time.Second)
	b.waitFor("the page empty once the storm is over", `(() => {
		const rows = document.querySelectorAll('#requests tbody tr').length, holds = document.querySelectorAll('#holds tbody tr').length;
		return rows === 0 && holds === 0 ? "" : rows + " requests, " + holds + " holds still shown";
	})()`)
}

// TestLiveViewShowsAStreamThatMoved opens the live view on a P/D pool with migration on
// (migrationPool: a simulated prefiller and two decoders) and kills the decoder a long curl
// stream runs on. While the stream goes on on the other decoder, its row must show a "moved
// 1×" badge, and the header the move: one stream moved, one moved in flight, the tokens it
// replayed, as /metrics counts them. Once curl is killed the row goes and the totals stay.
func TestLiveViewShowsAStreamThatMoved(t *testing.T) {
	s, _, ds := migrationPool(t, sim.ProtocolVLLM, true)
	dir := screenshotDir(t)
	b := openBrowser(t, s.url+"/debug/ui")
	stream := curlStream(t, s.url, "liveview-moved")
	b.waitFor("the stream decoding", `(`+jsRowState("requests", "liveview-moved")+` === "decoding") ? "" : "liveview-moved is "+`+jsRowState("requests", "liveview-moved"))
	var victim *sim.Server
	testutil.WaitFor(t, pageWait, func() (bool, string) {
		for _, d := range ds {
			if d.Engine().Stats().RunningRequests > 0 {
				victim = d
			}
		}
		return victim != nil, "no decoder runs the stream"
	})
	victim.Kill()
	// What the page shows of the move: the row's attempts and its badge, drawn, and the
	// header's counts.
	const moved = `(() => {
		const r = document.querySelector('#requests tr[data-id="liveview-moved"]'), m = document.getElementById("migrations");
		const badge = r && r.querySelector(".moved");
		const drawn = badge && badge.getBoundingClientRect().width > 0 && getComputedStyle(badge).visibility === "visible";
		const row = r ? "attempts " + r.dataset.attempts + ", badge " + (badge ? JSON.stringify(badge.textContent) + (drawn ? "" : " not drawn") : "none") : "no row";
		return {row, ok: !!(r && r.dataset.attempts === "1" && drawn && badge.textContent === "moved 1×"), header: m.textContent, data: {...m.dataset}};
	})()`
	b.waitFor("the stream shown as moved, the move in the header", `(() => {
		const v = `+moved+`;
		return v.ok && v.data.migrated === "1" && v.data.inFlight === "1" && Number(v.data.tokensReplayed) > 0 && v.header.includes("1 moved") ? "" :
			v.row + "; header " + JSON.stringify(v.header) + " " + JSON.stringify(v.data);
	})()`)
	b.screenshot(filepath.Join(dir, "liveview-moved.png"))
	if got, want := b.eval(`document.getElementById("migrations").dataset.tokensReplayed`),
		testutil.Value(t, s.m.Registry, "pdproxy_migration_tokens_replayed_total", nil); got != strconv.FormatFloat(want, 'f', -1, 64) {
		t.Errorf("the header shows %s tokens replayed, /metrics %v", got, want)
	}

	kill(t, stream)
	b.waitFor("the moved stream gone, its move still counted", `(() => {
		const r = document.querySelector('#requests tr[data-id="liveview-moved"]'), m = document.getElementById("migrations").dataset;
		return !r && m.migrated === "1" && m.inFlight === "0" ? "" : "row " + (r ? "still shown" : "gone") + ", header " + JSON.stringify({...m});
	})()`)
	testutil.WaitFor(t, 5*time.Second, func() (bool, string) {
		return s.m.Table.Len() == 0 && s.m.Table.OutstandingHolds() == 0, fmt.Sprintf("table %+v, %d holds", s.m.Table.Snapshot(), s.m.Table.OutstandingHolds())
	})
}

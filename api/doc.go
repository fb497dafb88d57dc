// Package api holds what the client's APIs look like on the wire, apart from how a request
// is served: the OpenAI completions, chat completions and Responses bodies and the Anthropic
// Messages body parsed and validated into a Request (request.go, messages.go, responses.go,
// generate.go); the errors in the OpenAI shape and their kinds, and in Anthropic's
// (errors.go, anthropic.go); the stages an answer passes on its way to the client: the
// Messages translation of a chat answer (ChatToMessages), an alias's name put back (Renamer),
// and the watch for each API's end of a stream (EndWatch, stream.go); and what the engines
// key a prompt's KV by beyond its tokens (cachekey.go). It keeps no state.
package api

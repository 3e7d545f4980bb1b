// Package openai is the OpenAI-compatible API that heads and the tracker
// serve and the tracker reads back: the request, response and stream-chunk
// types with meshgpu's extensions (meshgpu, meshgpu_end), ParseRequest (the
// one validation both run, so a bad request gets the same answer from
// either), the SSE writer and reader, a typed chunk reader, ids and the
// API's error answers. Error bodies themselves are wire.Error, the one
// shape hops and relays answer too; this package imports wire, never the
// other way. Prose: docs/protocol.md, "OpenAI API".
package openai

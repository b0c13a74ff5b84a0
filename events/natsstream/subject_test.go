package natsstream

import (
	"strings"
	"testing"

	"github.com/nats-io/nats.go"
	"github.com/stretchr/testify/require"
)

func TestEscapeTokenIsSubjectSafeAndReversible(t *testing.T) {
	tests := []struct{ name, token string }{
		{"", "~"},
		{"10.0.0.1:8000", "10~2E0~2E0~2E1~3A8000"},
		{"meta-llama/Llama-3.1-8B", "meta-llama~2FLlama-3~2E1-8B"},
		{"plain_name-1", "plain_name-1"},
		{"a~b", "a~7Eb"},
		{"*>. \t", "~2A~3E~2E~20~09"},
		{"ü", "~C3~BC"},
	}
	for _, tc := range tests {
		got := EscapeToken(tc.name)
		require.Equal(t, tc.token, got, "%q", tc.name)
		back, ok := UnescapeToken(got)
		require.True(t, ok)
		require.Equal(t, tc.name, back)
	}
	for _, bad := range []string{"", "~", "~4", "~G0", "a~"} {
		if bad == "~" {
			continue // the empty name
		}
		_, ok := UnescapeToken(bad)
		require.False(t, ok, "%q", bad)
	}
}

func FuzzEscapeToken(f *testing.F) {
	for _, s := range []string{"", "10.0.0.1:8000", "a~b", "*", "~41"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		tok := EscapeToken(s)
		require.NotEmpty(t, tok)
		require.False(t, strings.ContainsAny(tok, ".*> \t\r\n"), "token %q of %q", tok, s)
		back, ok := UnescapeToken(tok)
		require.True(t, ok)
		require.Equal(t, s, back)
		// Whatever a peer puts in a subject, unescaping neither panics nor
		// yields a token that escapes differently.
		if name, ok := UnescapeToken(s); ok && s != "" && !strings.Contains(s, "~") {
			require.Equal(t, s, name)
		}
	})
}

func FuzzParseBatch(f *testing.F) {
	f.Add("m", "10.0.0.1:8000", "0", "17", []byte{0x93})
	f.Add("", "", "-1", "x", []byte(nil))
	f.Fuzz(func(t *testing.T, model, pod, rank, seq string, data []byte) {
		h := nats.Header{}
		h.Set(HeaderModel, model)
		h.Set(HeaderPod, pod)
		h.Set(HeaderRank, rank)
		h.Set(HeaderSeq, seq)
		b, err := parseBatch(h, data)
		if err != nil {
			require.ErrorIs(t, err, ErrBadMessage)
			return
		}
		require.NotEmpty(t, b.Pod)
		require.GreaterOrEqual(t, b.Rank, 0)
		// What the relay writes, the replica reads back.
		m := Config{}.message(b, msgID(b.Model, b.Pod, b.Rank, b.Seq, b.Payload))
		again, err := parseBatch(m.Header, m.Data)
		require.NoError(t, err)
		require.Equal(t, b, again)
	})
}

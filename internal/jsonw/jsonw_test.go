package jsonw_test

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/kvsource/kvsource/internal/jsonw"
)

var cases = []string{"", "plain", `a"b\c`, "\b\f\n\r\t\x00\x1f\x7f", "<script>&amp;", "é中文🙂", "bad\xffutf8\xc3", "\u2028\u2029", "\xed\xa0\x80"}

func TestAppendStringWritesWhatEncodingJSONWrites(t *testing.T) {
	for _, s := range cases {
		want, err := json.Marshal(s)
		require.NoError(t, err)
		require.Equal(t, string(want), string(jsonw.AppendString(nil, s)), "%q", s)
	}
}

func FuzzAppendString(f *testing.F) {
	for _, s := range cases {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		want, err := json.Marshal(s)
		require.NoError(t, err)
		require.Equal(t, string(want), string(jsonw.AppendString([]byte("x"), s))[1:])
	})
}

package msgpackr

import (
	"bytes"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"math"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/vmihailenco/msgpack/v5"
	"github.com/vmihailenco/msgpack/v5/msgpcode"
)

// walkDepth bounds both walkers' nesting alike, so that they agree on what
// they refuse.
const walkDepth = 16

// walk renders every value of data, in order, one token per scalar or
// header, with the Reader.
func walk(data []byte) ([]string, error) {
	var r Reader
	r.Reset(data)
	var out []string
	for r.Len() > 0 {
		var err error
		if out, err = walkValue(&r, out, walkDepth); err != nil {
			return out, err
		}
	}
	return out, nil
}

func walkValue(r *Reader, out []string, depth int) ([]string, error) {
	c, err := r.Peek()
	if err != nil {
		return out, err
	}
	switch KindOf(c) {
	case KindNil:
		if !r.Nil() {
			return out, errors.New("Nil refused a nil")
		}
		return append(out, "nil"), nil
	case KindBool:
		v, err := r.Bool()
		return append(out, fmt.Sprint("bool ", v)), err
	case KindInt:
		if c == Uint64 || c <= 0x7f || (c >= Uint8 && c <= Uint32) {
			v, err := r.Uint()
			return append(out, fmt.Sprint("int ", v)), err
		}
		v, err := r.Int()
		return append(out, fmt.Sprint("int ", v)), err
	case KindFloat:
		v, err := r.Float()
		return append(out, fmt.Sprintf("float %x", math.Float64bits(v))), err
	case KindStr:
		v, err := r.Str()
		return append(out, "str "+hex.EncodeToString(v)), err
	case KindBin:
		v, err := r.Bin()
		return append(out, "bin "+hex.EncodeToString(v)), err
	case KindArray, KindMap:
		if depth == 0 {
			return out, ErrDepth
		}
		var n int
		if KindOf(c) == KindArray {
			n, err = r.ArrayLen()
			out = append(out, fmt.Sprint("array ", n))
		} else {
			n, err = r.MapLen()
			out = append(out, fmt.Sprint("map ", n))
			n *= 2
		}
		if err != nil {
			return out, err
		}
		for range n {
			if out, err = walkValue(r, out, depth-1); err != nil {
				return out, err
			}
		}
		return out, nil
	case KindExt:
		pos := r.Pos()
		err := r.Skip(0)
		return append(out, "ext "+hex.EncodeToString(r.Since(pos))), err
	}
	return out, r.Skip(0)
}

// oracleWalk renders data as walk does, with vmihailenco/msgpack.
func oracleWalk(data []byte) ([]string, error) {
	br := bytes.NewReader(data)
	d := msgpack.NewDecoder(br)
	var out []string
	for br.Len() > 0 {
		var err error
		if out, err = oracleValue(d, br, data, out, walkDepth); err != nil {
			return out, err
		}
	}
	return out, nil
}

func oracleValue(d *msgpack.Decoder, br *bytes.Reader, data []byte, out []string, depth int) ([]string, error) {
	c, err := d.PeekCode()
	if err != nil {
		return out, err
	}
	switch {
	case c == msgpcode.Nil:
		return append(out, "nil"), d.DecodeNil()
	case c == msgpcode.True || c == msgpcode.False:
		v, err := d.DecodeBool()
		return append(out, fmt.Sprint("bool ", v)), err
	case msgpcode.IsFixedNum(c) && c <= msgpcode.PosFixedNumHigh, c >= msgpcode.Uint8 && c <= msgpcode.Uint64:
		v, err := d.DecodeUint64()
		return append(out, fmt.Sprint("int ", v)), err
	case msgpcode.IsFixedNum(c), c >= msgpcode.Int8 && c <= msgpcode.Int64:
		v, err := d.DecodeInt64()
		return append(out, fmt.Sprint("int ", v)), err
	case c == msgpcode.Float || c == msgpcode.Double:
		v, err := d.DecodeFloat64()
		return append(out, fmt.Sprintf("float %x", math.Float64bits(v))), err
	case msgpcode.IsString(c) || msgpcode.IsBin(c):
		// The oracle would allocate what a hostile length claims: its
		// length is checked here first.
		n, err := d.DecodeBytesLen()
		if err != nil {
			return out, err
		}
		if n > br.Len() {
			return out, io.ErrUnexpectedEOF
		}
		v := make([]byte, n)
		if err := d.ReadFull(v); err != nil {
			return out, err
		}
		kind := "bin "
		if msgpcode.IsString(c) {
			kind = "str "
		}
		return append(out, kind+hex.EncodeToString(v)), nil
	case msgpcode.IsFixedArray(c) || c == msgpcode.Array16 || c == msgpcode.Array32,
		msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32:
		if depth == 0 {
			return out, ErrDepth
		}
		var n int
		if msgpcode.IsFixedMap(c) || c == msgpcode.Map16 || c == msgpcode.Map32 {
			n, err = d.DecodeMapLen()
			out = append(out, fmt.Sprint("map ", n))
			n *= 2
		} else {
			n, err = d.DecodeArrayLen()
			out = append(out, fmt.Sprint("array ", n))
		}
		if err != nil {
			return out, err
		}
		for range n {
			if out, err = oracleValue(d, br, data, out, depth-1); err != nil {
				return out, err
			}
		}
		return out, nil
	case msgpcode.IsExt(c) || msgpcode.IsFixedExt(c):
		pos := len(data) - br.Len()
		_, n, err := d.DecodeExtHeader()
		if err != nil {
			return out, err
		}
		if n > br.Len() {
			return out, io.ErrUnexpectedEOF
		}
		if err := d.ReadFull(make([]byte, n)); err != nil {
			return out, err
		}
		return append(out, "ext "+hex.EncodeToString(data[pos:len(data)-br.Len()])), nil
	}
	return out, d.Skip()
}

// FuzzReader checks the Reader against vmihailenco/msgpack as an oracle:
// on every input both accept the same sequence of values with the same
// contents, or both refuse it; and Skip accepts exactly what the walk
// does, ending where each value ends.
func FuzzReader(f *testing.F) {
	seeds := []any{
		nil, true, false, 0, 127, 128, -1, -32, -33, 255, 256, 65535, 65536, math.MaxUint32, uint64(math.MaxUint32) + 1,
		int64(math.MinInt64), uint64(math.MaxUint64), float32(1.5), 2.25, math.Inf(-1),
		"", "x", string(make([]byte, 40)), string(make([]byte, 300)), []byte{}, []byte{1, 2, 3}, make([]byte, 70000),
		[]any{1, "a", []byte{2}, nil}, map[string]any{"a": 1, "b": []int{1, 2}}, make([]int, 20), time.Unix(1, 2),
		[]any{[]any{[]any{map[string]any{"deep": []any{}}}}},
	}
	for _, s := range seeds {
		b, err := msgpack.Marshal(s)
		require.NoError(f, err)
		f.Add(b)
		if len(b) > 1 {
			f.Add(b[:len(b)-1])
		}
	}
	f.Add([]byte{0xc1})
	f.Add([]byte{0xc7, 0x03, 0x05, 'a', 'b', 'c', 0xd4, 0x01, 0x02})
	f.Add([]byte{0xdd, 0xff, 0xff, 0xff, 0xff})
	f.Add([]byte{0xdf, 0xff, 0xff, 0xff, 0xff, 0xa1, 'a'})
	f.Add([]byte{0xc9, 0xff, 0xff, 0xff, 0xff, 0x01})
	f.Fuzz(func(t *testing.T, data []byte) {
		got, err := walk(data)
		want, oerr := oracleWalk(data)
		if errors.Is(err, ErrDepth) || errors.Is(oerr, ErrDepth) {
			return
		}
		require.Equal(t, oerr == nil, err == nil, "reader error %v, oracle error %v", err, oerr)
		if err != nil {
			require.True(t, errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, ErrType) || errors.Is(err, ErrRange),
				"error %v wraps none of the package's errors", err)
			return
		}
		require.Equal(t, want, got)

		// Skip takes the same values, and only them.
		var r Reader
		r.Reset(data)
		for r.Len() > 0 {
			require.NoError(t, r.Skip(walkDepth))
		}
	})
}

func TestReaderRefusesWhatItIsNotAskedFor(t *testing.T) {
	tests := []struct {
		name string
		data []byte
		read func(*Reader) error
		want error
	}{
		{"empty", nil, func(r *Reader) error { _, err := r.Peek(); return err }, io.ErrUnexpectedEOF},
		{"array of a map", []byte{0x80}, func(r *Reader) error { _, err := r.ArrayLen(); return err }, ErrType},
		{"map of an array", []byte{0x90}, func(r *Reader) error { _, err := r.MapLen(); return err }, ErrType},
		{"array longer than the input", []byte{0xdd, 0, 0, 0, 2, 0}, func(r *Reader) error { _, err := r.ArrayLen(); return err }, io.ErrUnexpectedEOF},
		{"map longer than the input", []byte{0x82, 0, 0, 0}, func(r *Reader) error { _, err := r.MapLen(); return err }, io.ErrUnexpectedEOF},
		{"str of a bin", []byte{0xc4, 0}, func(r *Reader) error { _, err := r.Str(); return err }, ErrType},
		{"bin of a str", []byte{0xa0}, func(r *Reader) error { _, err := r.Bin(); return err }, ErrType},
		{"bytes of an int", []byte{0x01}, func(r *Reader) error { _, err := r.Bytes(); return err }, ErrType},
		{"str longer than the input", []byte{0xdb, 0xff, 0xff, 0xff, 0xff, 'a'}, func(r *Reader) error { _, err := r.Str(); return err }, io.ErrUnexpectedEOF},
		{"uint of a negative fixint", []byte{0xff}, func(r *Reader) error { _, err := r.Uint(); return err }, ErrRange},
		{"uint of a negative int64", []byte{0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0}, func(r *Reader) error { _, err := r.Uint(); return err }, ErrRange},
		{"int of a uint64 beyond int64", []byte{0xcf, 0x80, 0, 0, 0, 0, 0, 0, 0}, func(r *Reader) error { _, err := r.Int(); return err }, ErrRange},
		{"int cut short", []byte{0xcd, 0x01}, func(r *Reader) error { _, err := r.Int(); return err }, io.ErrUnexpectedEOF},
		{"uint of a float", []byte{0xcb, 0, 0, 0, 0, 0, 0, 0, 0}, func(r *Reader) error { _, err := r.Uint(); return err }, ErrType},
		{"float of a str", []byte{0xa0}, func(r *Reader) error { _, err := r.Float(); return err }, ErrType},
		{"bool of nil", []byte{0xc0}, func(r *Reader) error { _, err := r.Bool(); return err }, ErrType},
		{"uint32s beyond 32 bits", []byte{0xcf, 0, 0, 0, 1, 0, 0, 0, 0}, func(r *Reader) error { return r.Uint32s(make([]uint32, 1)) }, ErrRange},
		{"uint64s of a negative", []byte{0x01, 0xff}, func(r *Reader) error { _, err := r.Uint64s(make([]uint64, 2)); return err }, ErrRange},
		{"skip of the unused code", []byte{0xc1}, func(r *Reader) error { return r.Skip(8) }, ErrType},
		{"skip deeper than allowed", []byte{0x91, 0x91, 0x90}, func(r *Reader) error { return r.Skip(2) }, ErrDepth},
		{"skip of an extension longer than the input", []byte{0xc9, 0xff, 0xff, 0xff, 0xff, 0x01, 0x00}, func(r *Reader) error { return r.Skip(0) }, io.ErrUnexpectedEOF},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var r Reader
			r.Reset(tt.data)
			require.ErrorIs(t, tt.read(&r), tt.want)
		})
	}
}

func TestReaderReadsIntegersOfEveryWidthIntoSlices(t *testing.T) {
	want := []uint64{0, 127, 128, 255, 256, 65535, 65536, math.MaxUint32, math.MaxUint32 + 1, math.MaxUint64}
	var data []byte
	for _, v := range want {
		b, err := msgpack.Marshal(v)
		require.NoError(t, err)
		data = append(data, b...)
	}
	// And as signed encodings.
	data = append(data, 0xd0, 0x05, 0xd3, 0, 0, 0, 0, 0, 0, 0, 0x07)
	want = append(want, 5, 7)
	var r Reader
	r.Reset(data)
	got := make([]uint64, len(want)+1)
	n, err := r.Uint64s(got)
	require.ErrorIs(t, err, io.ErrUnexpectedEOF)
	require.Equal(t, len(want), n, "read up to the end of the input")
	require.Equal(t, want, got[:n])
	require.Zero(t, r.Len())

	r.Reset(data)
	small := make([]uint32, 8)
	require.NoError(t, r.Uint32s(small))
	require.Equal(t, []uint32{0, 127, 128, 255, 256, 65535, 65536, math.MaxUint32}, small)
	pos := r.Pos()
	require.ErrorIs(t, r.Uint32s(make([]uint32, 1)), ErrRange)
	require.Equal(t, pos, r.Pos(), "a refused value is not read")
}

func TestReaderStringsAliasTheInput(t *testing.T) {
	data := []byte{0xa2, 'h', 'i', 0xc4, 0x01, 0x07}
	var r Reader
	r.Reset(data)
	s, err := r.Str()
	require.NoError(t, err)
	require.Equal(t, "hi", string(s))
	b, err := r.Bytes()
	require.NoError(t, err)
	require.Equal(t, []byte{7}, b)
	data[1] = 'H'
	require.Equal(t, "Hi", string(s))
	require.Equal(t, 2, cap(s), "an aliased string cannot be appended into the input")
}

func TestWordReadsEveryIntegerAsItsBitPattern(t *testing.T) {
	tests := []struct {
		name string
		in   []byte
		want uint64
	}{
		{"positive fixint", []byte{0x05}, 5},
		{"negative fixint", []byte{0xff}, 1<<64 - 1},
		{"int8", []byte{0xd0, 0x80}, 1<<64 - 128},
		{"int16", []byte{0xd1, 0x80, 0x00}, 1<<64 - 1<<15},
		{"int32", []byte{0xd2, 0x80, 0, 0, 0}, 1<<64 - 1<<31},
		{"int64 minimum", []byte{0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0}, 1 << 63},
		{"uint64 maximum", []byte{0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}, 1<<64 - 1},
		{"uint32", []byte{0xce, 0xff, 0xff, 0xff, 0xff}, 1<<32 - 1},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var r Reader
			r.Reset(tc.in)
			got, err := r.Word()
			require.NoError(t, err)
			require.Equal(t, tc.want, got)
			require.Zero(t, r.Len())
		})
	}
	var r Reader
	r.Reset([]byte{0xa1, 'x'})
	_, err := r.Word()
	require.ErrorIs(t, err, ErrType)
}

func TestWordsReadsIntegersOfEitherSignUntilAnotherValue(t *testing.T) {
	data := []byte{0x05, 0xff, 0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0, 0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xfe, 0xd1, 0xff, 0x00, 0xc4, 0x01, 0x07}
	var r Reader
	r.Reset(data)
	dst := make([]uint64, 6)
	n, err := r.Words(dst)
	require.ErrorIs(t, err, ErrType)
	require.Equal(t, 5, n)
	require.Equal(t, []uint64{5, 1<<64 - 1, 1 << 63, 1<<64 - 2, 1<<64 - 256}, dst[:n])
	b, err := r.Bytes()
	require.NoError(t, err, "the reader stands at the value refused")
	require.Equal(t, []byte{7}, b)
}

// FuzzWords checks Words against vmihailenco/msgpack: every integer it
// reads is the oracle's, as its 64-bit pattern, and it stops at the first
// value that is no integer, standing at it.
func FuzzWords(f *testing.F) {
	for _, s := range [][]any{{1, -1, int64(math.MinInt64), uint64(math.MaxUint64)}, {-129, 70000, "x"}, {int8(-5), []byte{1}}} {
		var b []byte
		for _, v := range s {
			e, err := msgpack.Marshal(v)
			require.NoError(f, err)
			b = append(b, e...)
		}
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		var r Reader
		r.Reset(data)
		dst := make([]uint64, 8)
		n, err := r.Words(dst)
		dec := msgpack.NewDecoder(bytes.NewReader(data))
		for i := range n {
			v, derr := dec.DecodeInterface()
			require.NoError(t, derr)
			switch x := v.(type) {
			case int8, int16, int32, int64:
				require.Equal(t, uint64(toInt64(x)), dst[i])
			case uint8, uint16, uint32, uint64:
				require.Equal(t, toUint64(x), dst[i])
			default:
				t.Fatalf("Words read %d from a %T", dst[i], v)
			}
		}
		if err == nil {
			require.Equal(t, len(dst), n)
			return
		}
		require.True(t, errors.Is(err, ErrType) || errors.Is(err, io.ErrUnexpectedEOF), "%v", err)
	})
}

func toInt64(v any) int64 {
	switch x := v.(type) {
	case int8:
		return int64(x)
	case int16:
		return int64(x)
	case int32:
		return int64(x)
	}
	return v.(int64)
}

func toUint64(v any) uint64 {
	switch x := v.(type) {
	case uint8:
		return uint64(x)
	case uint16:
		return uint64(x)
	case uint32:
		return uint64(x)
	}
	return v.(uint64)
}

package mooncake

import (
	"bytes"
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

const goodLine = `{"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]}`

func TestReadGivesTheRecordsAndSkipsBlankLines(t *testing.T) {
	in := goodLine + "\n\n  \r\n" +
		`{"hash_ids":[0, 18446744073709551615],"output_length":0,"input_length":0,"timestamp":0,"session_id":"s"}` + "\r\n"
	recs, err := Read(strings.NewReader(in))
	require.NoError(t, err)
	require.Equal(t, []Record{
		{Timestamp: 27482, InputLength: 6955, OutputLength: 52, HashIDs: []uint64{46, 47, 48}},
		{HashIDs: []uint64{0, 1<<64 - 1}},
	}, recs)
}

func TestReadNamesTheLineAndFieldOfABadLine(t *testing.T) {
	for _, tc := range []struct {
		name, line string
		err        error
		msg        string
	}{
		{"syntax", `{"timestamp": 1,`, ErrMalformed, "line 2: unexpected end"},
		{"not an object", `[1, 2]`, ErrMalformed, "line 2: json: cannot unmarshal array"},
		{"missing hash_ids", `{"timestamp": 1, "input_length": 2, "output_length": 3}`, ErrMissingField, "line 2: hash_ids"},
		{"null hash_ids", `{"timestamp": 1, "input_length": 2, "output_length": 3, "hash_ids": null}`, ErrMissingField, "line 2: hash_ids"},
		{"missing timestamp", `{"input_length": 2, "output_length": 3, "hash_ids": [1]}`, ErrMissingField, "line 2: timestamp"},
		{"missing output_length", `{"timestamp": 1, "input_length": 2, "hash_ids": [1]}`, ErrMissingField, "line 2: output_length"},
		{"string timestamp", `{"timestamp": "1", "input_length": 2, "output_length": 3, "hash_ids": [1]}`, ErrBadValue, `line 2: timestamp: "1" is not a number`},
		{"fractional length", `{"timestamp": 1, "input_length": 2.5, "output_length": 3, "hash_ids": [1]}`, ErrBadValue, "line 2: input_length: 2.5 is not an integer"},
		{"exponent", `{"timestamp": 1e3, "input_length": 2, "output_length": 3, "hash_ids": [1]}`, ErrBadValue, "line 2: timestamp: 1e3 is not an integer"},
		{"negative length", `{"timestamp": 1, "input_length": 2, "output_length": -3, "hash_ids": [1]}`, ErrBadValue, "line 2: output_length: -3 is negative"},
		{"huge length", `{"timestamp": 1, "input_length": 2147483648, "output_length": 3, "hash_ids": [1]}`, ErrBadValue, "line 2: input_length: 2147483648 is out of range"},
		{"huge timestamp", `{"timestamp": 9223372036854775808, "input_length": 2, "output_length": 3, "hash_ids": [1]}`, ErrBadValue, "line 2: timestamp: 9223372036854775808 is out of range"},
		{"hash_ids object", `{"timestamp": 1, "input_length": 2, "output_length": 3, "hash_ids": {"a": 1}}`, ErrBadValue, `line 2: hash_ids: {"a": 1} is not an array`},
		{"empty hash_ids", `{"timestamp": 1, "input_length": 2, "output_length": 3, "hash_ids": [ ]}`, ErrBadValue, "line 2: hash_ids: empty"},
		{"negative id", `{"timestamp": 1, "input_length": 2, "output_length": 3, "hash_ids": [4, -5]}`, ErrBadValue, "line 2: hash_ids[1]: -5 is negative"},
		{"string id", `{"timestamp": 1, "input_length": 2, "output_length": 3, "hash_ids": [4, "5,6"]}`, ErrBadValue, `line 2: hash_ids[1]: "5,6"] is not a number`},
		{"fractional id", `{"timestamp": 1, "input_length": 2, "output_length": 3, "hash_ids": [4.0]}`, ErrBadValue, "line 2: hash_ids[0]: 4.0 is not an integer"},
		{"huge id", `{"timestamp": 1, "input_length": 2, "output_length": 3, "hash_ids": [18446744073709551616]}`, ErrBadValue, "line 2: hash_ids[0]: 18446744073709551616 is out of range"},
		{"nested id", `{"timestamp": 1, "input_length": 2, "output_length": 3, "hash_ids": [[1]]}`, ErrBadValue, "line 2: hash_ids[0]: [1]] is not a number"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			recs, err := Read(strings.NewReader(goodLine + "\n" + tc.line + "\n" + goodLine + "\n"))
			require.ErrorIs(t, err, tc.err)
			require.Nil(t, recs)
			var le *LineError
			require.ErrorAs(t, err, &le)
			require.Equal(t, 2, le.Line)
			require.Contains(t, err.Error(), "mooncake: "+tc.msg)
		})
	}
}

func TestReadBoundsTheLineAndTheIDs(t *testing.T) {
	ids := strings.Repeat("1,", MaxHashIDs) + "1"
	_, err := Read(strings.NewReader(goodLine + "\n" + `{"timestamp": 1, "input_length": 2, "output_length": 3, "hash_ids": [` + ids + "]}\n"))
	require.ErrorIs(t, err, ErrTooManyHashIDs)
	require.Contains(t, err.Error(), "line 2: hash_ids: more than 65536")

	long := `{"timestamp": 1, "input_length": 2, "output_length": 3, "hash_ids": [1], "pad": "` + strings.Repeat("x", MaxLineBytes) + `"}`
	_, err = Read(strings.NewReader(goodLine + "\n" + goodLine + "\n" + long + "\n"))
	require.ErrorIs(t, err, ErrLineTooLong)
	var le *LineError
	require.ErrorAs(t, err, &le)
	require.Equal(t, 3, le.Line)
}

type failingReader struct{}

func (failingReader) Read([]byte) (int, error) { return 0, errors.New("disk gone") }

func TestReadWrapsAReadError(t *testing.T) {
	_, err := Read(failingReader{})
	require.ErrorContains(t, err, "disk gone")
}

// FuzzRead checks that any input gives records that satisfy Read's
// contract or an error, never a panic, and that the records written back
// as JSON read back the same.
func FuzzRead(f *testing.F) {
	f.Add([]byte(goodLine + "\n" + goodLine))
	f.Add([]byte(`{"timestamp":-0,"input_length":0,"output_length":1,"hash_ids":[ 1 , 2 ]}`))
	f.Add([]byte(`{"timestamp":1,"input_length":2,"output_length":3,"hash_ids":[1,"2"]}`))
	f.Add([]byte("\n\n{}\n[]\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		recs, err := Read(bytes.NewReader(in))
		if err != nil {
			var le *LineError
			require.ErrorAs(t, err, &le)
			require.Positive(t, le.Line)
			return
		}
		var out bytes.Buffer
		for _, r := range recs {
			require.GreaterOrEqual(t, r.Timestamp, int64(0))
			require.GreaterOrEqual(t, r.InputLength, 0)
			require.GreaterOrEqual(t, r.OutputLength, 0)
			require.NotEmpty(t, r.HashIDs)
			require.LessOrEqual(t, len(r.HashIDs), MaxHashIDs)
			ids := fmt.Sprint(r.HashIDs)
			fmt.Fprintf(&out, `{"timestamp":%d,"input_length":%d,"output_length":%d,"hash_ids":%s}`+"\n",
				r.Timestamp, r.InputLength, r.OutputLength, strings.ReplaceAll(ids, " ", ","))
		}
		again, err := Read(&out)
		require.NoError(t, err)
		require.Equal(t, recs, again)
	})
}

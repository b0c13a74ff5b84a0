package main

import (
	"bytes"
	"io"
	"testing"

	"github.com/stretchr/testify/require"
)

func TestServeExitsWithUsageOnBadFlagsOneOnStartUpFailuresAndZeroOnHelp(t *testing.T) {
	var stderr bytes.Buffer
	require.Equal(t, 2, runServe([]string{"--events-connect", "nope"}, nil, io.Discard, &stderr))
	require.Contains(t, stderr.String(), "POD=tcp://HOST:PORT")
	require.Contains(t, stderr.String(), "usage: kvsource serve")
	require.Equal(t, 1, runServe([]string{"--algo", "md5", "--http", "127.0.0.1:0"}, nil, io.Discard, io.Discard))
	var stdout bytes.Buffer
	require.Equal(t, 0, runServe([]string{"--help"}, nil, &stdout, io.Discard))
	require.Contains(t, stdout.String(), "usage: kvsource serve")
	require.Contains(t, stdout.String(), "POST /v1/pick")
}

func TestCalibrateExitsTwoNamingTheBadFlag(t *testing.T) {
	var stderr bytes.Buffer
	require.Equal(t, 2, run([]string{"calibrate", "--source", "http://h:1", "--model", "m"}, nil, io.Discard, &stderr))
	require.Contains(t, stderr.String(), "--consumer, --source and --model are required")
}

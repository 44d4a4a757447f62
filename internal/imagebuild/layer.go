package imagebuild

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"strconv"
	"strings"
	"time"

	v1 "github.com/google/go-containerregistry/pkg/v1"
	"github.com/google/go-containerregistry/pkg/v1/tarball"
	"github.com/google/go-containerregistry/pkg/v1/types"
)

// baseTime is the mtime of every entry of the base layer. It is the Unix epoch rather than the commit's
// time so that the base layer's digest changes only when its content does: a node that pulled one
// release already holds the base layer of the next.
var baseTime = time.Unix(0, 0).UTC()

// entry is one file or directory of a layer. Directory names end in "/".
type entry struct {
	name     string
	mode     int64
	uid, gid int
	data     []byte
}

func dir(name string, mode int64) entry { return entry{name: name + "/", mode: mode} }

// passwd and group name root and the image's user; the shells do not exist, on purpose.
var (
	passwd = "root:x:0:0:root:/root:/sbin/nologin\n" +
		UserName + ":x:" + strconv.Itoa(UID) + ":" + strconv.Itoa(GID) + ":" + UserName + ":/home/" + UserName + ":/sbin/nologin\n"
	group = "root:x:0:\n" + UserName + ":x:" + strconv.Itoa(GID) + ":\n"
)

// baseEntries is the content of the base layer, parents before children.
func baseEntries(caBundle []byte) []entry {
	home := dir("home/"+UserName, 0o700)
	home.uid, home.gid = UID, GID
	return []entry{
		dir("etc", 0o755),
		{name: "etc/group", mode: 0o644, data: []byte(group)},
		{name: "etc/passwd", mode: 0o644, data: []byte(passwd)},
		dir("etc/ssl", 0o755),
		dir("etc/ssl/certs", 0o755),
		{name: strings.TrimPrefix(CABundlePath, "/"), mode: 0o644, data: caBundle},
		dir("home", 0o755),
		home,
		dir("root", 0o700),
		// The agent's and the bus's scratch space when a manifest mounts nothing there; sticky and
		// world-writable as on any Linux, so root and the image's user can both use it.
		dir("tmp", 0o1777),
	}
}

// binaryEntries is the content of the binary's layer.
func binaryEntries(bin []byte) []entry {
	return []entry{
		dir("usr", 0o755),
		dir("usr/local", 0o755),
		dir("usr/local/bin", 0o755),
		{name: strings.TrimPrefix(BinaryPath, "/"), mode: 0o755, data: bin},
	}
}

// layerData is a built layer and its uncompressed digest, which the config lists.
type layerData struct {
	layer  v1.Layer
	diffID v1.Hash
}

// newLayer writes entries as a gzip-compressed tar in which nothing comes from the machine: the
// times are mtime, the owners are numeric with no names, the format is USTAR (no PAX records with
// access or change times), and the gzip header has no name and no time. The compressed bytes are kept
// and handed to go-containerregistry as they are, so that it does not compress them again at its own
// level.
func newLayer(entries []entry, mtime time.Time) (layerData, error) {
	var gz bytes.Buffer
	zw, err := gzip.NewWriterLevel(&gz, gzip.BestCompression)
	if err != nil {
		return layerData{}, err
	}
	// The diff ID is the digest of the uncompressed tar: hashed on the way through, not kept.
	raw := sha256.New()
	tw := tar.NewWriter(io.MultiWriter(raw, zw))
	for _, e := range entries {
		h := &tar.Header{
			Name:    e.name,
			Mode:    e.mode,
			Uid:     e.uid,
			Gid:     e.gid,
			ModTime: mtime.Truncate(time.Second),
			Format:  tar.FormatUSTAR,
		}
		if strings.HasSuffix(e.name, "/") {
			h.Typeflag = tar.TypeDir
		} else {
			h.Typeflag, h.Size = tar.TypeReg, int64(len(e.data))
		}
		if err := tw.WriteHeader(h); err != nil {
			return layerData{}, fmt.Errorf("tar header %s: %w", e.name, err)
		}
		if _, err := tw.Write(e.data); err != nil {
			return layerData{}, fmt.Errorf("tar %s: %w", e.name, err)
		}
	}
	if err := tw.Close(); err != nil {
		return layerData{}, err
	}
	if err := zw.Close(); err != nil {
		return layerData{}, err
	}
	diffID := v1.Hash{Algorithm: "sha256", Hex: hex.EncodeToString(raw.Sum(nil))}
	blob := gz.Bytes()
	l, err := tarball.LayerFromOpener(func() (io.ReadCloser, error) {
		return io.NopCloser(bytes.NewReader(blob)), nil
	}, tarball.WithMediaType(types.OCILayer))
	if err != nil {
		return layerData{}, err
	}
	return layerData{layer: l, diffID: diffID}, nil
}

package records

import (
	"fmt"
	"testing"
	"time"

	"github.com/imagefleet/imagefleet/events"
	"github.com/imagefleet/imagefleet/services/cri"
)

// Helpers named as in the kubelet's image_gc_manager_test.go.
func imageID(i int) string { return fmt.Sprintf("image-%d", i) }

func makeImage(i int, size int64) cri.Image { return cri.Image{ID: imageID(i), Size: size} }

func makeContainer(i int) cri.Container {
	return cri.Container{ID: fmt.Sprintf("container-%d", i), ImageID: imageID(i)}
}

var zero time.Time

// TestDetectImagesInitialDetect is the kubelet's TestDetectImagesInitialDetect.
func TestDetectImagesInitialDetect(t *testing.T) {
	records := map[string]events.ImageRecord{}
	images := []cri.Image{makeImage(0, 1024), makeImage(1, 2048), makeImage(2, 2048)}
	containers := []cri.Container{{ID: "container-1", ImageID: imageID(1)}, makeContainer(2)}
	start := time.Now()
	ch := Detect(records, images, containers, zero, time.Now())
	if len(records) != 3 || len(ch.Added) != 3 {
		t.Fatalf("records = %d, added = %d, want 3 and 3", len(records), len(ch.Added))
	}
	r0 := records[imageID(0)]
	if !r0.FirstDetected.Equal(zero) || !r0.LastUsed.Equal(zero) || r0.InUse {
		t.Errorf("image-0 = %+v, want zero times and not in use", r0)
	}
	for _, i := range []int{1, 2} {
		r := records[imageID(i)]
		if !r.FirstDetected.Equal(zero) || r.LastUsed.Before(start) || !r.InUse {
			t.Errorf("image-%d = %+v, want firstDetected zero, lastUsed after start, in use", i, r)
		}
	}
}

// TestDetectImagesWithNewImage is the kubelet's TestDetectImagesWithNewImage.
func TestDetectImagesWithNewImage(t *testing.T) {
	records := map[string]events.ImageRecord{}
	Detect(records, []cri.Image{makeImage(0, 1024), makeImage(1, 2048)}, []cri.Container{makeContainer(1)}, zero, time.Now())
	if len(records) != 2 {
		t.Fatalf("records = %d, want 2", len(records))
	}
	start := time.Now()
	detected := zero.Add(time.Second)
	ch := Detect(records, []cri.Image{makeImage(0, 1024), makeImage(1, 1024), makeImage(2, 1024)}, []cri.Container{makeContainer(1)}, detected, time.Now())
	if len(records) != 3 || len(ch.Added) != 1 || ch.Added[0].ID != imageID(2) {
		t.Fatalf("records = %d, added = %+v", len(records), ch.Added)
	}
	if r := records[imageID(0)]; !r.FirstDetected.Equal(zero) || !r.LastUsed.Equal(zero) {
		t.Errorf("image-0 = %+v", r)
	}
	if r := records[imageID(1)]; !r.FirstDetected.Equal(zero) || r.LastUsed.Before(start) || r.Size != 1024 {
		t.Errorf("image-1 = %+v (size must refresh to 1024)", r)
	}
	if r := records[imageID(2)]; !r.FirstDetected.Equal(detected) || !r.LastUsed.Equal(zero) {
		t.Errorf("image-2 = %+v, want firstDetected zero+1s", r)
	}
}

// TestDetectImagesContainerStopped is the kubelet's TestDetectImagesContainerStopped: lastUsed stays exactly
// as it was once no container uses the image.
func TestDetectImagesContainerStopped(t *testing.T) {
	records := map[string]events.ImageRecord{}
	images := []cri.Image{makeImage(0, 1024), makeImage(1, 2048)}
	Detect(records, images, []cri.Container{makeContainer(1)}, zero, time.Now())
	used := records[imageID(1)].LastUsed
	ch := Detect(records, images, nil, time.Now(), time.Now().Add(time.Minute))
	if len(records) != 2 {
		t.Fatalf("records = %d, want 2", len(records))
	}
	if r := records[imageID(0)]; !r.FirstDetected.Equal(zero) || !r.LastUsed.Equal(zero) {
		t.Errorf("image-0 = %+v", r)
	}
	r1 := records[imageID(1)]
	if !r1.FirstDetected.Equal(zero) || !r1.LastUsed.Equal(used) || r1.InUse {
		t.Errorf("image-1 = %+v, want lastUsed %v and not in use", r1, used)
	}
	if len(ch.Updated) != 1 || ch.Updated[0].ID != imageID(1) {
		t.Errorf("updated = %+v, want only image-1 (inUse changed)", ch.Updated)
	}
}

// TestDetectImagesWithRemovedImages is the kubelet's TestDetectImagesWithRemovedImages.
func TestDetectImagesWithRemovedImages(t *testing.T) {
	records := map[string]events.ImageRecord{}
	Detect(records, []cri.Image{makeImage(0, 1024), makeImage(1, 2048)}, []cri.Container{makeContainer(1)}, zero, time.Now())
	ch := Detect(records, nil, nil, time.Now(), time.Now())
	if len(records) != 0 || len(ch.Removed) != 2 {
		t.Fatalf("records = %d, removed = %d, want 0 and 2", len(records), len(ch.Removed))
	}
}

// TestDetectDuplicateIDLastWins mirrors the kubelet's TestDeletePinnedImage set-up: one record per ID, the last
// listing entry wins.
func TestDetectDuplicateIDLastWins(t *testing.T) {
	records := map[string]events.ImageRecord{}
	ch := Detect(records, []cri.Image{{ID: "pause", Size: 1024, Pinned: true}, {ID: "pause", Size: 1024}}, nil, zero, time.Now())
	if len(records) != 1 || records["pause"].Pinned || len(ch.Added) != 1 || ch.Added[0].Pinned {
		t.Fatalf("records = %+v, added = %+v; want one unpinned record", records, ch.Added)
	}
}

// TestDetectExitedContainersKeepImagesInUse: every container the runtime still lists counts, running or not.
func TestDetectExitedContainersKeepImagesInUse(t *testing.T) {
	records := map[string]events.ImageRecord{}
	c := makeContainer(0)
	c.State = cri.ContainerExited
	Detect(records, []cri.Image{makeImage(0, 1)}, []cri.Container{c}, zero, time.Now())
	if !records[imageID(0)].InUse || records[imageID(0)].LastUsed.IsZero() {
		t.Fatalf("exited container's image not in use: %+v", records[imageID(0)])
	}
}

// Package imagebuild assembles imagefleet's container image (an OCI image index over one image per
// platform) from prebuilt static binaries, without Docker and without a base image, so that the same
// commit gives the same digests on any machine.
package imagebuild

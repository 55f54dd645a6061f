"""Conditioning images (HunyuanImage-3.0-Instruct): read, checked, shared with every rank, decoded.

One set of rules for every way an image arrives: `--image a.png[,b.png,c.png]` (run_image_gen.py),
a prompts-file line's `"image"` (relative to the prompts file's folder), a YAML's `image` (relative
to the project root, as its other paths), and POST /v1/images/edits (multipart `image[]` or base64
in JSON). Each image is at most MAX_IMAGE_BYTES as a file and MAX_IMAGE_PIXELS decoded: the server's
limits, the CLI's too (a small file may decode huge; upstream resizes every image to the model's
resolution buckets, so nothing bigger helps). Upstream's Instruct model takes 1 to MAX_IMAGES.

Only rank 0 reads the files (and the HTTP side only sees rank 0's process): an InputImage carries
the file's bytes to the other ranks (run_image_gen.py broadcasts --prompt's; the rank loop
broadcasts each request with its images), so a rank never reads another copy of a file that may
differ (another node, a file rewritten meanwhile). Before each image the ranks compare the
digests of what they hold (`same_on_every_rank`). Every rank decodes the same bytes the same way
(`decode`); upstream's own `load_image` then applies the EXIF orientation and converts to RGB, as
it does for a path.
"""
from __future__ import annotations

import hashlib
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from adaptor_patches.weights.regular_files import read_regular_bytes, regular_file_problem
from utils.runtime.requests.errors import FieldError
from utils.runtime.requests.request_schema import MAX_IMAGES  # noqa: F401  (the count rule is the schema's)

MAX_IMAGE_BYTES = 20 << 20         # per image, as a file or as sent
MAX_IMAGE_PIXELS = 8192 * 8192     # per image, decoded
FORMATS_FIX = "give a PNG, JPEG or WebP file"


@dataclass(frozen=True)
class InputImage:
    """One conditioning image as every rank receives it: its name in messages and its file's bytes."""
    name: str                      # the path given, or image[2] for an HTTP upload
    data: bytes

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.data).hexdigest()


def bytes_problem(data: bytes) -> Optional[tuple]:
    """(problem, fix) when `data` is not an image file within the limits, else None; the problem
    follows the image's name ("has ...", "is not ..."). The pixels are decoded once here (a
    truncated file fails now, not on the ranks)."""
    from PIL import Image
    if len(data) > MAX_IMAGE_BYTES:
        return f"has {len(data)} bytes, more than {MAX_IMAGE_BYTES} ({MAX_IMAGE_BYTES >> 20} MiB)", "use a smaller file"
    try:
        with Image.open(io.BytesIO(data)) as opened:
            width, height = opened.size
            if width * height > MAX_IMAGE_PIXELS:
                return (f"has {width}x{height} pixels, more than {MAX_IMAGE_PIXELS} (8192x8192)",
                        "use a smaller image (the model resizes it to its own resolutions anyway)")
            opened.load()
    except Exception as exc:           # PIL raises many kinds for a file that is not a whole image
        return f"is not an image PIL can read ({type(exc).__name__})", FORMATS_FIX
    return None


def read_image(path, field: str = "image", split_from: Optional[str] = None) -> InputImage:
    """One image file, read whole and checked; FieldError naming `field` (missing, a folder, not a
    regular file, unreadable, not an image, too large). `split_from`: the argument it was cut from
    at a comma, named when the file is missing (the comma may have been meant as part of a name)."""
    path = Path(path)
    shown = os.fspath(path)
    if not path.exists():
        split = "" if split_from is None else \
            f" (a name split from {split_from!r} at its commas; a comma inside a file name is written \\,)"
        raise FieldError(field, f"{shown} does not exist{split}", "check the path (relative paths: see docs/CLI.md)")
    if path.is_dir():
        raise FieldError(field, f"{shown} is a directory", "name an image file")
    problem = regular_file_problem(path)
    if problem:                             # a named pipe would keep the read waiting for good
        raise FieldError(field, f"{shown} {problem}", "name an image file")
    try:
        size = path.stat().st_size
        if size > MAX_IMAGE_BYTES:          # not read: a 2 GB file would be, whole
            raise FieldError(field, f"{shown} has {size} bytes, more than {MAX_IMAGE_BYTES} ({MAX_IMAGE_BYTES >> 20} "
                                    f"MiB)", "use a smaller file")
        data = read_regular_bytes(path)
    except OSError as exc:
        raise FieldError(field, f"cannot read {shown} ({exc.strerror or exc})", "fix its permissions or copy it") from None
    problem = bytes_problem(data)
    if problem:
        raise FieldError(field, f"{shown} {problem[0]}", problem[1])
    return InputImage(shown, data)


def read_images(paths, field: str = "image") -> tuple:
    """`paths` (request_schema.ImagePaths: with the argument they were split from) read and checked."""
    return tuple(read_image(path, field, split_from(paths)) for path in paths or ())


def split_from(paths) -> Optional[str]:
    """The one argument `paths` were cut from at its commas, if they were (ImagePaths.given)."""
    given = getattr(paths, "given", None)
    return given if given is not None and len(paths) > 1 else None


def decode(image: InputImage):
    """The PIL image every rank builds from the same bytes (upstream's load_image finishes it)."""
    from PIL import Image
    opened = Image.open(io.BytesIO(image.data))
    opened.load()
    return opened


class InputImageError(ValueError):
    """A request's images could not be read on rank 0 when it ran (every rank raises it alike)."""


def with_images(request, read=read_images):
    """Rank 0, just before a request is handed to every rank: its `image` files read into
    `image_inputs` (a file gone or changed since the job check: `image_problem`, and the request
    fails alike on every rank)."""
    from dataclasses import replace
    if not request.image or request.image_inputs is not None:
        return request
    try:
        return replace(request, image_inputs=read(request.image))
    except FieldError as exc:
        return replace(request, image_problem=str(exc))


class ImagesDisagree(RuntimeError):
    """A rank holds other conditioning images than rank 0."""


def request_images(request, dist=None) -> list:
    """Every rank: the request's images decoded (an empty list for text to image), after the ranks
    compared their images' digests (`same_on_every_rank`)."""
    if getattr(request, "image_problem", None):
        raise InputImageError(request.image_problem)
    return decoded_images(request.image_inputs or (), dist)


def decoded_images(inputs, dist=None) -> list:
    """Every rank: `inputs` (InputImage) decoded, after the ranks compared their digests."""
    same_on_every_rank(dist, inputs)
    return [decode(image) for image in inputs]


def same_on_every_rank(dist, inputs) -> None:
    """The images came from rank 0, so every rank holds the same bytes; their digests are compared
    anyway (one small all-gather per image request), so that a change letting a rank read its own
    copy fails here, naming the rank, instead of hanging in a collective (another size: other token
    counts) or silently mixing two images into one."""
    if dist is None or dist.get_world_size() == 1:
        return
    mine = [(image.name, image.digest) for image in inputs]
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    def shown(images):
        return ", ".join(f"{name} sha256 {digest[:12]}" for name, digest in images) or "none"

    for rank, theirs in enumerate(every):
        if theirs != every[0]:
            raise ImagesDisagree(f"image: rank {rank} holds other conditioning images ({shown(theirs)}) than rank 0 "
                                 f"({shown(every[0])}); every rank must use the bytes rank 0 read")


def share_images(dist, images: Optional[tuple]) -> tuple:
    """--prompt's images, read on rank 0, to every rank (the bytes; each rank decodes them alike)."""
    box = [images if dist is None or dist.get_rank() == 0 else None]
    if dist is not None:
        dist.broadcast_object_list(box, src=0)
    return box[0] or ()

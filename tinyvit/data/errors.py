"""The errors the data layer raises. Every message names the file, folder or URL involved.

    DataError                   base class: catch this in a command-line tool and print the message
      DataFileMissing           a file the dataset needs is not there (also a FileNotFoundError)
      DataFormatError           a file is there but malformed (also a ValueError)
        UnsafePickleError       a pickle asked for a class outside the allowed list
      DownloadError             fetching, checking or extracting a download failed
      DatasetUnavailable        the dataset is neither on disk nor downloadable; says what to do
"""


class DataError(RuntimeError):
    """Base class of every error raised by tinyvit.data."""


class DataFileMissing(DataError, FileNotFoundError):
    """A file the dataset needs does not exist."""


class DataFormatError(DataError, ValueError):
    """A file exists but its content is not what the format says it must be."""


class UnsafePickleError(DataFormatError):
    """A pickle referenced a class or function that the restricted unpickler refuses to load."""


class DownloadError(DataError):
    """Downloading, verifying or extracting a file failed (nothing half-done is left behind)."""


class DatasetUnavailable(DataError):
    """The dataset could not be found or fetched; the message says how to provide it by hand."""

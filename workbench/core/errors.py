"""User-facing errors: one clear sentence, no traceback needed."""


class WorkbenchError(Exception):
    """An error whose message is meant for the user as it is (the CLI prints it and exits 2)."""


class ModelFormatError(WorkbenchError):
    """A model file or folder is missing, truncated, foreign or of an unsupported architecture."""


class PlacementError(WorkbenchError):
    """A placement does not fit the model or the budget."""


class ProjectFileError(WorkbenchError):
    """A project file is corrupt, of an unknown version, or points to a model that moved."""

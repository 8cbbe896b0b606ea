"""The browser tier: headless Chromium (Debian's ``chromium``, installed by ``make browser``). Where
it is absent, every test here is skipped with that one line, never silently."""

import pytest

from tests.browser.cdp import find_chromium
from tests.helpers.skips import skip_folder


def pytest_collection_modifyitems(config, items):
    skip_folder(items, "browser", None if find_chromium() else
                "chromium not found on PATH (make browser installs Debian's chromium where apt-get can)")


@pytest.fixture
def chromium(tmp_path):
    """``chromium()`` -> a headless ``Chromium`` with a fresh profile (closed at teardown)."""
    from tests.browser.cdp import Chromium

    browsers = []

    def start(**kw):
        browsers.append(Chromium(find_chromium(), tmp_path / f"profile{len(browsers)}", **kw))
        return browsers[-1]

    yield start
    for browser in browsers:
        browser.close()
